"""One field's arenas on this host (one per worker), mapped side by side at fixed strides in
one reserved range of address space: row r of arena a is row a * stride + r of the window,
so one `np.take` reads a group's rows from all of them. A mapping only grows while the
window lives, so a row index valid once stays readable. Linux and macOS (MAP_FIXED).
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from .hugepages import HUGE, aligned_reservation, release
from .libc import MAP_FIXED, libc, populate_soon

MAX_ARENAS = 16  # arenas (workers of one host) a window can hold
POPULATE_BYTES = 1 << 30  # of each arena file faulted in ahead, as it is mapped


class Window:
    """Arena files of one field, mapped read-only `stride` rows apart. Not thread-safe: its owner serialises."""

    def __init__(self, reserved: tuple[int, int], stride: int, row_bytes: int, dtype: str, row_shape: tuple):
        """`reserved`: (the reservation, its HUGE-aligned start), as `aligned_reservation` gives."""
        (self._reservation, self._base), self.stride, self._row_bytes = reserved, stride, row_bytes
        self._dtype, self._row_shape = np.dtype(dtype), tuple(row_shape)
        self._mapped: list[int] = [0] * MAX_ARENAS  # rows mapped per arena
        total = stride * row_bytes * MAX_ARENAS
        memory = (ctypes.c_char * total).from_address(self._base)
        self.rows = np.frombuffer(memory, dtype=self._dtype).reshape((stride * MAX_ARENAS,) + self._row_shape)

    @classmethod
    def open(cls, max_rows: int, dtype: str, row_shape: tuple) -> Window | None:
        """A window for arenas of up to `max_rows` rows each (at most this host's memory); None if unreservable."""
        row_bytes = np.dtype(dtype).itemsize * int(np.prod(row_shape, dtype=np.int64))
        if row_bytes == 0:
            return None
        # rows per stride step: arenas start on huge pages (`shm.hugepages`), or on pages where that
        # alignment would reserve more than 64 huge pages a step (row sizes with a large odd factor)
        aligned = int(np.lcm(row_bytes, HUGE))
        unit = (aligned if aligned <= 64 * HUGE else int(np.lcm(row_bytes, mmap.PAGESIZE))) // row_bytes
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        stride = int(-(-min(max_rows, memory // row_bytes + 1) // unit) * unit)
        reserved = aligned_reservation(stride * row_bytes * MAX_ARENAS)
        if reserved is None:
            return None
        return cls(reserved, stride, row_bytes, dtype, row_shape)

    def map(self, arena: int, path: str, rows: int, ahead: bool = True) -> None:
        """Arena `arena`'s file mapped with at least `rows` rows, else FileNotFoundError;
        `ahead`: its first POPULATE_BYTES faulted in by another thread meanwhile."""
        if rows <= self._mapped[arena]:
            return
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            have = min(size // self._row_bytes, self.stride)
            if have < rows:
                raise FileNotFoundError(f"{path} holds fewer rows than {rows}")
            length = have * self._row_bytes
            at = self._base + arena * self.stride * self._row_bytes
            got = libc.mmap(at, length, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, f.fileno(), 0)
            if got != at:
                raise OSError(ctypes.get_errno(), f"cannot map {path}: {os.strerror(ctypes.get_errno())}")
        # a new process's first batches then take fewer page faults; the first GiB of a file only
        # (2 MiB of page tables on 4 KiB pages): no page tables for the rest, which a rank may never read
        if ahead:
            populate_soon(at, min(length, POPULATE_BYTES), write=False)
        self._mapped[arena] = have

    def close(self) -> None:
        """Unmap everything. The caller guarantees no array of `rows` is in use."""
        release(self._reservation, self.stride * self._row_bytes * MAX_ARENAS)
        self.rows = None
