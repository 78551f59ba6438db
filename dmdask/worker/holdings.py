"""What a worker holds under a block's key: `Holding`s, one protocol for all of them
(`FillingBlock`, the one filled as ranks ask, is in `dmdask.worker.filling`). Their files'
formats are `dmdask.shm`'s: training processes read them too."""
from __future__ import annotations

import shutil

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


def payload_bytes(arrays: Arrays) -> int:
    """Bytes of the samples themselves (an object array: its elements' bytes only)."""
    return sum(a.nbytes if a.dtype != object else sum(v.nbytes for v in a) for a in arrays.values())


def concat(arrays):
    """One array of the rows of `arrays` (object arrays of per-sample arrays too)."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


class Holding:
    """What a worker holds under a block's key, samples `start..stop-1` of a dataset.

    `tier`: the tier it is charged to (None: streamed); `describe()`: how a process on
    this host maps its rows (None: it cannot); `serve(rows, cache, priority)`: (the rows,
    how many were read from the store); `take(rows)`: rows of a holding that holds them
    all; `release()`: when it leaves the tier; `rereadable`: whether unreadable files
    are read again from the store (`BlockCache._reread`)."""

    __slots__ = ()
    tier: str | None = "ram"
    rereadable = False

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def samples(self) -> int:
        """Samples charged to the tier (a `FillingBlock` charges them as read)."""
        return len(self)

    def describe(self) -> dict | None:
        return None

    async def serve(self, rows: np.ndarray, cache, priority: float) -> tuple[Arrays, int]:
        return self.take(rows), 0

    def release(self) -> None:
        """Nothing to free beyond the object itself."""


class Block(Holding):
    """Samples `start..stop-1` of a dataset as one array per field (first axis: samples);
    variable-size fields are object arrays of per-sample `uint8` arrays."""

    __slots__ = ("arrays", "nbytes", "start", "stop")

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


class Streamed(Holding):
    """Stands in the worker's data for a block that fits no tier: its reader, to stream
    the rows asked for from the store (one file per sample), else the whole block
    through the `StreamBuffer`, read once while the ranks take their rows of it."""

    __slots__ = ("reader",)
    tier = None
    nbytes = 0

    def __init__(self, reader):
        self.reader = reader

    @property
    def start(self) -> int:
        return self.reader.start

    @property
    def stop(self) -> int:
        return self.reader.stop

    async def serve(self, rows: np.ndarray, cache, priority: float) -> tuple[Arrays, int]:
        if self.reader.row_granular:  # nothing is held afterwards
            return await cache.in_thread(priority, cache.read_rows, self.reader, rows), len(rows)
        block = await cache.stream.get(self.reader, priority)
        out = block.take(rows)
        cache.stream.served(self.reader.key, len(rows))
        return out, len(rows)

    def __reduce__(self):
        return (Streamed, (self.reader,))

    def __sizeof__(self) -> int:
        return 64


class _InFiles(Holding):
    """A block in files of this host (`dmdask.shm`) that leaves the worker as its data;
    its rows are copied out in a read thread."""

    __slots__ = ()

    async def serve(self, rows: np.ndarray, cache, priority: float) -> tuple[Arrays, int]:
        return await cache.in_thread(priority, self.take, rows), 0

    def __reduce__(self):  # leaving this worker (a graceful retire, a gather): travel as the data itself
        return (Block, (self.take(np.arange(len(self))), self.start, self.stop))

    def __sizeof__(self) -> int:
        return 256


class FileBlock(_InFiles):
    """A block kept in files (`dmdask.shm.fileblocks`; shared memory for the RAM tier, the
    node's disk for the SSD), which a training process on the same host maps itself.
    `reader`: the block's `BlockReader` when it was read here (None: from another
    worker), to read it again should its files fail."""

    __slots__ = ("layout", "nbytes", "path", "reader", "start", "stop", "tier")

    def __init__(self, path: str, start: int, stop: int, nbytes: int, layout: tuple, tier: str, reader=None):
        self.path, self.start, self.stop, self.nbytes = path, start, stop, nbytes
        self.layout = layout  # (name, kind, dtype, shape): kind "fixed", "ragged" or "strings"
        self.tier = tier
        self.reader = reader

    @classmethod
    def write(cls, directory: str, block: Block, tier: str, reader=None) -> FileBlock:
        """Write `block` under a new folder of `directory`; on error nothing is left behind."""
        path, layout = fileblocks.write(directory, block.arrays, block.start)
        return cls(path, block.start, block.stop, block.nbytes, layout, tier, reader)

    @property
    def rereadable(self) -> bool:
        return self.reader is not None

    def _description(self) -> dict:
        return {"path": self.path, "layout": self.layout, "tier": self.tier}

    def describe(self) -> dict | None:
        """What a process on the same host needs to map this block (`map_arrays`); None
        when a file is gone or of another size (rows then come through the worker,
        which reads the block again)."""
        return self._description() if fileblocks.files_exist(self.path, self.layout, len(self)) else None

    def take(self, rows: np.ndarray) -> Arrays:
        """The given rows, copied out of the files. Thread-safe."""
        return take_rows(map_arrays(self._description()), rows)

    def release(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class ArenaBlock(_InFiles):
    """A RAM-tier block held in a slot of its dataset's arena (`dmdask.shm.arena`)."""

    __slots__ = ("arena", "nbytes", "slot", "start", "stop", "tier")

    def __init__(self, arena: Arena, slot: int, start: int, stop: int, nbytes: int):
        self.arena, self.slot, self.start, self.stop, self.nbytes = arena, slot, start, stop, nbytes
        self.tier = "ram"

    def describe(self) -> dict:
        """What a process on the same host needs to take this block's rows (`ArenaMaps`)."""
        return {"arena": self.arena.fields, "first_row": self.slot * self.arena.block_len, "start": self.start,
                "tier": "ram"}

    def take(self, rows: np.ndarray) -> Arrays:
        return ArenaMaps.shared.take(self.describe(), rows)

    def release(self) -> None:
        self.arena.free(self.slot)


class GroupHeld:
    """The value of a load group's key (`dmdask.plan.groups`): the keys of its blocks,
    each held under its own key in the same `TieredStore`, which releases them with it."""

    def __init__(self, keys: list[str]):
        self.keys = list(keys)

    def __sizeof__(self) -> int:
        return 64 + 8 * len(self.keys)
