"""RAM-tier blocks of fixed-size fields packed into one shared-memory file per dataset and
field (an arena): a block of L samples occupies a slot of L rows (slots of released blocks
are reused), written once and never changed while held; readers index rows slot * L +
offset with no lock. A file of int64 row labels (`ID_FIELD`, -1: none) is cleared when a
slot is freed (a new slot within an earlier arena's bytes of the file: before it is first
written) and labelled after the slot is written, so a reader that checks the labels after
taking the rows never returns rows of a released or reused slot (`NotHeld`). The files
only grow. A `block` here: the worker's `Block` (`arrays`, `start`)."""
from __future__ import annotations

import contextlib
import mmap
import os
import threading

import numpy as np

from ..protocol.pieces import byte_view
from .fileblocks import Arrays
from .hugepages import HUGE, collapse, map_read_only
from .modes import create_file, group_of

ID_FIELD = "__id__"  # the arena file that labels each row with the sample id it holds
LABEL_ROWS = 1 << 16  # row labels written at a time (512 KiB): a block's labels take no block-sized array
_STEPS = np.arange(LABEL_ROWS, dtype=np.int64)


class NotHeld(FileNotFoundError):
    """The rows asked for no longer hold the samples expected (released, moved, reused)."""


def all_fixed(block) -> bool:
    """Whether every field of `block` has fixed-size rows (an arena can hold it)."""
    return ID_FIELD not in block.arrays and all(
        arr.dtype != object and arr.dtype.kind not in "TOUS" for arr in block.arrays.values())


class Arena:
    """The slots of one dataset's blocks in a worker's shared-memory folder. Thread-safe."""

    def __init__(self, folder: str, identity: str, block_len: int, block):
        self.block_len = block_len
        self.fields: dict[str, tuple[str, str, tuple]] = {}  # name -> (path, dtype, row shape)
        self._fds: dict[str, int] = {}
        gid = group_of(folder)
        layouts = {name: (arr.dtype.str, tuple(arr.shape[1:])) for name, arr in block.arrays.items()}
        for name, (dtype, row_shape) in {**layouts, ID_FIELD: ("<i8", ())}.items():
            path = os.path.join(folder, f"{identity}.{name}")
            self.fields[name] = (path, dtype, row_shape)
            self._fds[name] = create_file(path, gid, os.O_RDWR)
        self._free: list[tuple[int, bool]] = []  # (slot, whether its labels were cleared when it was freed)
        # the labels' file bytes an earlier arena of this file may have written (a slot past them reads as
        # never labelled, and no reader was told of it): new slots within them are cleared before their first write
        self._labelled_before = os.fstat(self._fds[ID_FIELD]).st_size
        self._slots = 0
        self._row_bytes = {name: np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
                           for name, (_, dtype, shape) in self.fields.items()}
        self._written: set[int] = set()  # slots written at least once, beyond `_prefix`
        self._prefix = 0  # slots 0.._prefix-1 all written at least once: their bytes have no holes
        # field -> bytes from the start backed by huge pages; the labels only where a row's data is at least
        # a label's 8 bytes (a copy into huge pages costs its bytes: 4x the data of 2-byte tokens)
        data_bytes = sum(size for name, size in self._row_bytes.items() if name != ID_FIELD)
        self._collapsed = {name: 0 for name in self.fields if name != ID_FIELD or data_bytes >= 8}
        self._huge = True  # until the kernel refuses (`shm.hugepages`)
        self._lock = threading.Lock()

    def fits(self, block) -> bool:
        return set(block.arrays) | {ID_FIELD} == set(self.fields) and all(
            arr.dtype.str == self.fields[n][1] and tuple(arr.shape[1:]) == self.fields[n][2]
            for n, arr in block.arrays.items()) and len(block) <= self.block_len

    def write(self, block) -> int:
        """Copy `block` into a free slot: the slot. OSError (ENOSPC), nothing held, when full."""
        with self._lock:
            if self._free:
                slot, cleared = self._free.pop()
            else:  # a new slot: never labelled if past the bytes an earlier arena of this file may have written
                slot = self._slots
                cleared = slot * self.block_len * self._row_bytes[ID_FIELD] >= self._labelled_before
            self._slots = max(self._slots, slot + 1)
        try:
            if not cleared:
                self._label(slot, None)
            for name, arr in block.arrays.items():
                if len(arr) < self.block_len:  # the last block: the slot's tail written too, so it has no hole
                    arr = np.concatenate([arr, np.zeros((self.block_len - len(arr),) + arr.shape[1:], arr.dtype)])
                self._write(name, slot, arr)
            self._label(slot, block)
        except BaseException:
            self.free(slot)
            raise
        self._collapse_written(slot)
        return slot

    def _collapse_written(self, slot: int) -> None:
        """Slot `slot` is written: the whole 2 MiB extents of the slots written without a gap
        from the start backed by huge pages (`shm.hugepages`; the kernel refuses extents with
        holes, which slots other threads are still writing would leave)."""
        with self._lock:
            self._written.add(slot)
            while self._prefix in self._written:
                self._written.discard(self._prefix)
                self._prefix += 1
            ranges = {}
            for name in self._collapsed:
                end = self._prefix * self.block_len * self._row_bytes[name] // HUGE * HUGE
                if end > self._collapsed[name]:
                    ranges[name] = (self._collapsed[name], end)
                    self._collapsed[name] = end
        for name, (start, end) in ranges.items():
            if self._huge and not collapse(self._fds[name], start, end):
                self._huge = False  # refused with no hole: this kernel gives shared memory no huge pages

    def free(self, slot: int) -> None:
        """Give the slot back; its rows read as held by no sample from now on (cleared
        here, so that `write` need not clear them again before it writes the slot)."""
        cleared = False
        with contextlib.suppress(OSError):  # shared memory gone: nothing left to read anyway
            self._label(slot, None)
            cleared = True
        with self._lock:
            self._free.append((slot, cleared))

    def _label(self, slot: int, block) -> None:
        """Label the slot's rows with `block`'s sample ids, -1 past its end (None: all -1),
        LABEL_ROWS at a time, in row order."""
        held = 0 if block is None else len(block)
        ids = np.empty(min(LABEL_ROWS, self.block_len), dtype=np.int64)
        for first in range(0, self.block_len, LABEL_ROWS):
            labels = ids[:min(LABEL_ROWS, self.block_len - first)]
            labelled = max(0, min(len(labels), held - first))  # rows of the block in this chunk
            np.add(_STEPS[:labelled], block.start + first if labelled else 0, out=labels[:labelled])
            labels[labelled:] = -1
            self._write(ID_FIELD, slot, labels, first)

    def _write(self, name: str, slot: int, arr: np.ndarray, first_row: int = 0) -> None:
        """`arr` written as the slot's rows from `first_row` on."""
        data = np.ascontiguousarray(arr)
        row_bytes = data.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))
        offset = (slot * self.block_len + first_row) * row_bytes
        view = byte_view(data)
        while view:
            written = os.pwrite(self._fds[name], view, offset)
            view, offset = view[written:], offset + written

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ArenaMaps:
    """Arena files mapped read-only in one process, remapped when they have grown."""

    shared: ArenaMaps

    def __init__(self):
        self._maps: dict[str, np.ndarray] = {}
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
                raise NotHeld(f"{path} holds fewer rows than {needed}")
            # huge-page aligned: a row server's reads of random rows take no TLB miss a 4 KiB page
            pages = map_read_only(f.fileno(), size) or mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        rows = size // row_bytes  # whole rows only: a file being extended grows a page at a time
        count = rows * (row_bytes // np.dtype(dtype).itemsize)
        array = np.frombuffer(pages, dtype=dtype, count=count).reshape((rows,) + tuple(row_shape))
        with self._lock:
            self._maps[path] = array
        return array

    def take(self, description: dict, offsets: np.ndarray) -> Arrays:
        """Rows (offsets in the block) of an arena block (`ArenaBlock.describe`)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        return self.take_rows(description["arena"], description["first_row"] + offsets, description["start"] + offsets)

    def take_rows(self, fields: dict, rows: np.ndarray, ids: np.ndarray) -> Arrays:
        """The fields' values at arena rows `rows`, which must hold samples `ids` (else
        NotHeld: the labels are read after the rows); FileNotFoundError when the worker is gone."""
        needed = int(rows.max()) + 1 if len(rows) else 0
        taken = {name: self.rows(path, dtype, shape, needed)[rows]
                 for name, (path, dtype, shape) in fields.items() if name != ID_FIELD}
        held = self.rows(*fields[ID_FIELD], needed)[rows]
        if not np.array_equal(held, ids):
            raise NotHeld(f"rows of {fields[ID_FIELD][0]} no longer hold samples {ids[held != ids][:3].tolist()}")
        return taken

    def forget(self, path: str) -> None:
        with self._lock:
            self._maps.pop(path, None)

    def remake_lock(self) -> None:
        """In a forked child (a parent thread may have held the lock; the mappings stay valid)."""
        self._lock = threading.Lock()


ArenaMaps.shared = ArenaMaps()
os.register_at_fork(after_in_child=ArenaMaps.shared.remake_lock)
