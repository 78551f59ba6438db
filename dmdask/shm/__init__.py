"""The shared-memory layer: the files workers write and training processes on their host
read (`arena`, `fileblocks`, `results`, their `modes`), and the readers' `window` and pooled
`memory`. `dmdask.worker` writes through it, `dmdask.client` reads through it."""
