"""The shared-memory layer: files a worker writes and training processes on its host read
(arenas, file blocks, result files: `arena`, `fileblocks`, `results`; who may read them:
`modes`), and the reader's side (`window`: arenas mapped side by side; `memory`: pooled
batch memory). `dmdask.worker` writes through it and `dmdask.client` reads through it;
it imports neither.
"""
