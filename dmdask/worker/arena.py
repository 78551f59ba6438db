"""RAM-tier blocks of fixed-size fields packed into one shared-memory file per dataset and
field (an arena), so a training process on the same host takes the rows of many blocks
with one indexing operation per field instead of one per block.

Block k of a dataset with blocks of L samples occupies a slot of L rows; slots of
released blocks are reused. A block is written once (when it is loaded) and never
changed while held, so readers need no lock: they map the file and index rows
slot * L + offset. The file only grows while the worker lives; it is removed with the
worker's shared-memory folder.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Dict, List, Tuple

import numpy as np

from .holdings import Arrays, Block


def all_fixed(block: Block) -> bool:
    """Whether every field of `block` has fixed-size rows (an arena can hold it)."""
    return all(arr.dtype != object and arr.dtype.kind not in "TOUS" for arr in block.arrays.values())


class Arena:
    """The slots of one dataset's blocks in a worker's shared-memory folder. Thread-safe."""

    def __init__(self, folder: str, identity: str, block_len: int, block: Block):
        self.block_len = block_len
        self.fields: Dict[str, Tuple[str, str, tuple]] = {}  # name -> (path, dtype, row shape)
        self._fds: Dict[str, int] = {}
        for name, arr in block.arrays.items():
            path = os.path.join(folder, f"{identity}.{name}")
            self.fields[name] = (path, arr.dtype.str, tuple(arr.shape[1:]))
            self._fds[name] = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._free: List[int] = []
        self._slots = 0
        self._lock = threading.Lock()

    def fits(self, block: Block) -> bool:
        return set(block.arrays) == set(self.fields) and all(
            arr.dtype.str == self.fields[n][1] and tuple(arr.shape[1:]) == self.fields[n][2]
            for n, arr in block.arrays.items()) and len(block) <= self.block_len

    def write(self, block: Block) -> int:
        """Copy `block` into a free slot; returns the slot. OSError (ENOSPC) when shared
        memory is full, with nothing held."""
        with self._lock:
            slot = self._free.pop() if self._free else self._slots
            self._slots = max(self._slots, slot + 1)
        try:
            for name, arr in block.arrays.items():
                data = np.ascontiguousarray(arr)
                row_bytes = data.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))
                offset = slot * self.block_len * row_bytes
                view = memoryview(data).cast("B")
                while view:
                    written = os.pwrite(self._fds[name], view, offset)
                    view, offset = view[written:], offset + written
        except BaseException:
            self.free(slot)
            raise
        return slot

    def free(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ArenaBlock:
    """A RAM-tier block held in a slot of its dataset's arena."""

    __slots__ = ("arena", "slot", "start", "stop", "nbytes", "tier")

    def __init__(self, arena: Arena, slot: int, start: int, stop: int, nbytes: int):
        self.arena, self.slot, self.start, self.stop, self.nbytes = arena, slot, start, stop, nbytes
        self.tier = "ram"

    @property
    def samples(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return self.stop - self.start

    def describe(self) -> dict:
        """What a process on the same host needs to take this block's rows (`ArenaMaps`)."""
        return {"arena": self.arena.fields, "first_row": self.slot * self.arena.block_len, "tier": "ram"}

    def take(self, rows: np.ndarray) -> Arrays:
        return ArenaMaps.shared.take(self.describe(), rows)

    def load(self) -> Block:
        return Block(self.take(np.arange(len(self))), self.start, self.stop)

    def __reduce__(self):
        # Leaving this worker (a graceful retire, a gather): travel as the data itself.
        block = self.load()
        return (Block, (block.arrays, block.start, block.stop))

    def __sizeof__(self) -> int:
        return 256


class ArenaMaps:
    """Arena files mapped read-only in one process, remapped when they have grown."""

    shared: "ArenaMaps"

    def __init__(self):
        self._maps: Dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def rows(self, path: str, dtype: str, row_shape: tuple, needed: int) -> np.ndarray:
        """The file as an array of rows, mapped with at least `needed` rows."""
        with self._lock:
            found = self._maps.get(path)
        if found is not None and len(found) >= needed:
            return found
        with open(path, "rb") as f:  # FileNotFoundError once the worker is gone
            size = os.fstat(f.fileno()).st_size
            row_bytes = np.dtype(dtype).itemsize * int(np.prod(row_shape, dtype=np.int64))
            if size < needed * row_bytes:
                raise FileNotFoundError(f"{path} holds fewer rows than {needed}")
            pages = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        array = np.frombuffer(pages, dtype=dtype).reshape((size // row_bytes,) + tuple(row_shape))
        with self._lock:
            self._maps[path] = array
        return array

    def take(self, description: dict, rows: np.ndarray) -> Arrays:
        """Rows (offsets in the block) of an arena block."""
        global_rows = description["first_row"] + np.asarray(rows, dtype=np.int64)
        needed = int(global_rows.max()) + 1 if len(global_rows) else 0
        return {name: self.rows(path, dtype, shape, needed)[global_rows]
                for name, (path, dtype, shape) in description["arena"].items()}

    def forget(self, path: str) -> None:
        with self._lock:
            self._maps.pop(path, None)


ArenaMaps.shared = ArenaMaps()
