"""The shared-memory layer: the files workers write (`arena`, `fileblocks`, `results`, their
`modes`) and training processes on their host read (through a `window`, into `memory`)."""
