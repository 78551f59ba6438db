"""What a worker holds under a block's key, each with `take(rows)`.

- `Block`: the samples in the worker's memory, one array per field;
- `FillingBlock`: a RAM block of a one-file-per-sample source, filled as ranks ask;
- `FileBlock`: the samples in files (shared memory for RAM, the SSD), mapped to take rows;
- `Streamed`: a marker for a block that fits no tier (read from the store when asked).
"""
from __future__ import annotations

import asyncio
import errno
import mmap
import os
import shutil
import tempfile
from typing import Dict, Optional

import numpy as np

from .modes import create_file, group_of, protect_folder

Arrays = Dict[str, np.ndarray]


def arrays_nbytes(arrays: Arrays) -> int:
    """Bytes held by the arrays; an object array counts its elements' bytes too."""
    total = 0
    for arr in arrays.values():
        total += arr.nbytes
        if arr.dtype == object:
            total += sum(getattr(v, "nbytes", 0) for v in arr)
    return total


class Span:
    """Samples `start..stop-1` of a dataset: the part every holding shares."""

    __slots__ = ()

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def samples(self) -> int:
        return self.stop - self.start


class Block(Span):
    """Samples `start..stop-1` of a dataset as one array per field (first axis: samples).

    Variable-size fields are object arrays of per-sample `uint8` arrays.
    """

    __slots__ = ("arrays", "start", "stop", "nbytes")

    def __init__(self, arrays: Arrays, start: int, stop: int):
        self.arrays = arrays
        self.start = start
        self.stop = stop
        self.nbytes = arrays_nbytes(arrays)

    def take(self, rows: np.ndarray) -> Arrays:
        """The given rows (offsets inside the block), in that order."""
        return {name: arr[rows] for name, arr in self.arrays.items()}

    def __reduce__(self):
        return (Block, (self.arrays, self.start, self.stop))

    def __sizeof__(self) -> int:  # what Dask's memory accounting reads
        return self.nbytes


class Streamed:
    """Stands in the worker's data for a block that did not fit any tier.

    Holding the reader (not the bytes), it lets the worker stream the block from the
    shared store when a rank asks for its rows.
    """

    __slots__ = ("reader",)

    def __init__(self, reader):
        self.reader = reader

    def __reduce__(self):
        return (Streamed, (self.reader,))

    def __sizeof__(self) -> int:
        return 64


class FillingBlock:
    """A RAM block of a one-file-per-sample source, filled sample by sample as ranks ask.

    Each sample is read from the store the first time a rank wants it, so epoch 1
    streams like a plain loader, and every sample kept is read once for the whole run.
    `sized`: the block's whole room was reserved when it was created (its size came
    from the listing); otherwise (an HTTP folder lists no sizes) each sample is charged
    to the tier when read, and samples the tier has no room for are served and not
    kept. Used only from the worker's event loop (reads run in threads, fills happen on
    the loop). `reading`: row -> the future of the read under way that brings it, so a
    row asked twice at once is read once, and a request never waits for reads of rows
    it did not ask for.
    """

    __slots__ = ("reader", "arrays", "have", "nbytes", "samples", "sized", "start", "stop", "reading")

    def __init__(self, reader, sized: bool = True):
        n = reader.stop - reader.start
        self.reader = reader
        self.arrays = None  # field -> array, made on the first fill
        self.have = np.zeros(n, dtype=bool)
        self.sized = sized
        self.nbytes = reader.nbytes if sized else 0
        self.samples = n if sized else 0  # samples charged to the tier
        self.start, self.stop = reader.start, reader.stop
        self.reading: Dict[int, "asyncio.Future"] = {}

    def __len__(self) -> int:
        return self.stop - self.start

    def missing(self, rows: np.ndarray) -> np.ndarray:
        """The rows not read yet, each once, in increasing order."""
        return np.unique(rows[~self.have[rows]])

    def fill(self, rows: np.ndarray, arrays: Arrays) -> None:
        if not len(rows):
            return
        if self.arrays is None:
            self.arrays = {}
            for name, values in arrays.items():
                shape = (len(self),) + values.shape[1:]
                self.arrays[name] = np.empty(shape, dtype=values.dtype)
        for name, values in arrays.items():
            self.arrays[name][rows] = values
        self.have[rows] = True

    @property
    def complete(self) -> bool:
        return bool(self.have.all())

    def take(self, rows: np.ndarray, spare_rows=None, spare: Arrays = None) -> Arrays:
        """The given rows: held ones from the block, the others from `spare` (the arrays
        of `spare_rows`, increasing, just read and not kept)."""
        held = self.have[rows]
        if held.all():
            return {name: arr[rows] for name, arr in self.arrays.items()}
        where = np.searchsorted(spare_rows, rows[~held])
        out = {}
        for name, values in spare.items():
            col = np.empty((len(rows),) + values.shape[1:], dtype=values.dtype)
            if held.any():
                col[held] = self.arrays[name][rows[held]]
            col[~held] = values[where]
            out[name] = col
        return out

    def __reduce__(self):
        # Leaving the worker (a graceful retirement): travel as a complete block.
        arrays = self.arrays if self.complete else self.reader.read()
        return (Block, (arrays, self.start, self.stop))

    def __sizeof__(self) -> int:
        return self.nbytes


def sample_nbytes(arrays: Arrays) -> np.ndarray:
    """Bytes each sample of `arrays` takes in memory (an object array's element plus its
    8-byte pointer; a row of a fixed-size field)."""
    n = len(next(iter(arrays.values())))
    sizes = np.zeros(n, dtype=np.int64)
    for arr in arrays.values():
        if arr.dtype == object:
            sizes += np.fromiter((v.nbytes for v in arr), dtype=np.int64, count=n) + 8
        else:
            sizes += arr.nbytes // max(1, n)
    return sizes


class FileBlock(Span):
    """A block kept in files: one raw file per field, read by memory map, so a take reads
    only the wanted rows. Variable-size fields (object arrays of per-sample uint8 arrays,
    and numpy string arrays) are stored as values plus offsets. The RAM tier keeps its
    blocks in shared memory (a folder in `/dev/shm`), the SSD tier on the node's disk:
    either way a training process on the same host maps the files read-only
    (`describe`, `map_arrays`) and takes its rows without asking the worker.

    Every dtype and shape is kept in this object when the block is written, so reads
    parse no file header (`np.load` parses `.npy` headers with `ast.literal_eval`, which
    is not thread-safe on CPython 3.11: python/cpython#106905).

    `reader`: the block's `BlockReader` when the block was read from the shared store
    here (None when it came from another worker), so a block whose files can no longer
    be read can be read again from the store.
    """

    __slots__ = ("path", "start", "stop", "nbytes", "layout", "tier", "reader")

    def __init__(self, path: str, start: int, stop: int, nbytes: int, layout: tuple, tier: str, reader=None):
        self.path, self.start, self.stop, self.nbytes = path, start, stop, nbytes
        self.layout = layout  # (name, kind, dtype, shape): kind "fixed", "ragged" or "strings"
        self.tier = tier
        self.reader = reader

    @classmethod
    def write(cls, directory: str, block: Block, tier: str, reader=None) -> "FileBlock":
        """Write `block` under a new folder of `directory`; on error nothing is left behind."""
        gid = group_of(directory)
        path = tempfile.mkdtemp(dir=directory, prefix=f"b{block.start}-")
        protect_folder(path, gid)  # mapped read-only by training processes of this user (or group)
        layout = []
        try:
            for name, arr in block.arrays.items():
                if arr.dtype == object or arr.dtype.kind == "T":
                    kind = "ragged" if arr.dtype == object else "strings"
                    values = [v.encode() for v in arr.tolist()] if kind == "strings" else list(arr)
                    sizes = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
                    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
                    flat = (np.frombuffer(b"".join(values), dtype=np.uint8) if kind == "strings"
                            else np.concatenate(values) if values else np.zeros(0, np.uint8))
                    _write(path, f"{name}.values", flat, gid)
                    _write(path, f"{name}.offsets", offsets, gid)
                    layout.append((name, kind, flat.dtype.str, flat.shape))
                else:
                    _write(path, name, arr, gid)
                    layout.append((name, "fixed", arr.dtype.str, arr.shape))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, block.start, block.stop, block.nbytes, tuple(layout), tier, reader)

    def describe(self) -> dict:
        """What a process on the same host needs to map this block (`map_arrays`)."""
        return {"path": self.path, "layout": self.layout, "tier": self.tier}

    def files_exist(self) -> bool:
        """Whether every file of the block is still there with the size its layout says
        (they may have been deleted or replaced)."""
        sizes = {}
        for name, kind, dtype, shape in self.layout:
            nbytes = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
            if kind == "fixed":
                sizes[name] = nbytes
            else:
                sizes[f"{name}.values"], sizes[f"{name}.offsets"] = nbytes, 8 * (len(self) + 1)
        try:
            return all(os.path.getsize(os.path.join(self.path, n)) == size for n, size in sizes.items())
        except OSError:
            return False

    def take(self, rows: np.ndarray) -> Arrays:
        """The given rows, copied out of the files. Thread-safe."""
        return take_rows(map_arrays(self.describe()), rows)

    def load(self) -> Block:
        return Block(self.take(np.arange(self.stop - self.start)), self.start, self.stop)

    def __reduce__(self):
        # Leaving this worker (a graceful retire, a gather): travel as the data itself.
        block = self.load()
        return (Block, (block.arrays, block.start, block.stop))

    def __sizeof__(self) -> int:
        return 256


def readable(description: Optional[dict]) -> bool:
    """Whether this process may map the files of a block's description (`FileBlock` or
    `ArenaBlock.describe`): a worker's folders are its user's (or group's) only, so a
    process of another user takes the block's rows through the worker instead."""
    if description is None:
        return False
    path = description["path"] if "path" in description else next(iter(description["arena"].values()))[0]
    return os.access(path, os.R_OK)


def map_arrays(description: dict) -> dict:
    """The fields of a `FileBlock` mapped read-only: an array per fixed field, and
    (values, offsets) per variable-size field. Raises FileNotFoundError once the block
    was released."""
    path, out = description["path"], {}
    for name, kind, dtype, shape in description["layout"]:
        if kind == "fixed":
            out[name] = (kind, _map(os.path.join(path, name), dtype, shape))
        else:
            offsets = np.fromfile(os.path.join(path, f"{name}.offsets"), dtype=np.int64)
            out[name] = (kind, (_map(os.path.join(path, f"{name}.values"), dtype, shape), offsets))
    return out


def take_rows(mapped: dict, rows: np.ndarray) -> Arrays:
    """Rows of a mapped block (`map_arrays`), copied into new arrays."""
    out = {}
    for name, (kind, data) in mapped.items():
        if kind == "fixed":
            out[name] = data[rows]
            continue
        values, offsets = data
        if kind == "strings":
            out[name] = np.array([bytes(values[offsets[r]:offsets[r + 1]]).decode() for r in rows],
                                 dtype=np.dtypes.StringDType())
        else:
            col = np.empty(len(rows), dtype=object)
            for i, r in enumerate(rows.tolist()):
                col[i] = np.array(values[offsets[r]:offsets[r + 1]])
            out[name] = col
    return out


def _map(path: str, dtype: str, shape: tuple) -> np.ndarray:
    """A read-only array over the file's pages (a plain ndarray: indexing it costs what
    indexing memory costs, without `np.memmap`'s per-call Python overhead)."""
    if 0 in shape:
        return np.zeros(shape, dtype=dtype)
    expected = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != expected:  # not the file the block wrote (replaced, truncated): as if gone
            raise FileNotFoundError(errno.ENOENT, f"holds {size} bytes where its block's layout {dtype} {shape} "
                                    f"takes {expected}: not this block's file any more", path)
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(pages, dtype=dtype).reshape(shape)


def _write(directory: str, name: str, arr: np.ndarray, gid: Optional[int]) -> None:
    with os.fdopen(create_file(os.path.join(directory, name), gid), "wb") as f:  # a full disk: OSError(ENOSPC)
        f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
