"""What a worker holds under a block's key, each with `take(rows)`.

- `Block`: the samples in the worker's memory, one array per field;
- `FillingBlock`: a RAM block of a one-file-per-sample source, filled as ranks ask;
- `FileBlock`: the samples in files (shared memory for RAM, the SSD), mapped to take rows;
- `ArenaBlock`: a RAM block in a slot of its dataset's arena (shared memory);
- `Streamed`: a marker for a block that fits no tier (read from the store when asked).
Their files' formats are `dmdask.shm`'s (training processes read them too)."""
from __future__ import annotations

import asyncio
from typing import Dict

import numpy as np

from ..shm import fileblocks
from ..shm.arena import Arena, ArenaMaps
from ..shm.fileblocks import Arrays, map_arrays, take_rows


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


class _InFiles(Span):
    """A block in files of this host (`dmdask.shm`) that leaves the worker as its data."""

    __slots__ = ()

    def load(self) -> Block:
        return Block(self.take(np.arange(len(self))), self.start, self.stop)

    def __reduce__(self):
        # Leaving this worker (a graceful retire, a gather): travel as the data itself.
        block = self.load()
        return (Block, (block.arrays, block.start, block.stop))

    def __sizeof__(self) -> int:
        return 256


class FileBlock(_InFiles):
    """A block kept in files (`dmdask.shm.fileblocks`; shared memory for the RAM tier, the
    node's disk for the SSD): a take reads only the wanted rows, and a training process on
    the same host maps the files itself (`describe`). `reader`: the block's `BlockReader`
    when it was read from the store here (None when it came from another worker), so a
    block whose files can no longer be read can be read again from the store."""

    __slots__ = ("path", "start", "stop", "nbytes", "layout", "tier", "reader")

    def __init__(self, path: str, start: int, stop: int, nbytes: int, layout: tuple, tier: str, reader=None):
        self.path, self.start, self.stop, self.nbytes = path, start, stop, nbytes
        self.layout = layout  # (name, kind, dtype, shape): kind "fixed", "ragged" or "strings"
        self.tier = tier
        self.reader = reader

    @classmethod
    def write(cls, directory: str, block: Block, tier: str, reader=None) -> "FileBlock":
        """Write `block` under a new folder of `directory`; on error nothing is left behind."""
        path, layout = fileblocks.write(directory, block.arrays, block.start)
        return cls(path, block.start, block.stop, block.nbytes, layout, tier, reader)

    def describe(self) -> dict:
        """What a process on the same host needs to map this block (`map_arrays`)."""
        return {"path": self.path, "layout": self.layout, "tier": self.tier}

    def files_exist(self) -> bool:
        """Whether every file of the block is still there with the size its layout says."""
        return fileblocks.files_exist(self.path, self.layout, len(self))

    def take(self, rows: np.ndarray) -> Arrays:
        """The given rows, copied out of the files. Thread-safe."""
        return take_rows(map_arrays(self.describe()), rows)


class ArenaBlock(_InFiles):
    """A RAM-tier block held in a slot of its dataset's arena (`dmdask.shm.arena`)."""

    __slots__ = ("arena", "slot", "start", "stop", "nbytes", "tier")

    def __init__(self, arena: Arena, slot: int, start: int, stop: int, nbytes: int):
        self.arena, self.slot, self.start, self.stop, self.nbytes = arena, slot, start, stop, nbytes
        self.tier = "ram"

    def describe(self) -> dict:
        """What a process on the same host needs to take this block's rows (`ArenaMaps`)."""
        return {"arena": self.arena.fields, "first_row": self.slot * self.arena.block_len, "start": self.start,
                "tier": "ram"}

    def take(self, rows: np.ndarray) -> Arrays:
        return ArenaMaps.shared.take(self.describe(), rows)
