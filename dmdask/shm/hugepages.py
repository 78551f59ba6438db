"""Huge pages for arena files without root: `collapse` asks the kernel (Linux >= 6.1,
`MADV_COLLAPSE`) to back whole 2 MiB extents of a shared-memory file with transparent huge
pages. Once an extent is a huge page in the page cache, every process that maps it at a
2 MiB-aligned address (`shm.window`) maps it with one page-table entry instead of 512, so
a new training process's first pass over the arenas takes a fraction of the page faults.

Guarantees: best effort and never raises; the file's bytes are unchanged; where the kernel
refuses (older kernel, `shmem_enabled=deny`, no memory for a huge page), nothing changes.
"""
from __future__ import annotations

import ctypes
import mmap
import os

HUGE = 2 << 20  # bytes of a PMD-mapped huge page on x86-64 and arm64 (4 KiB base pages)
_MADV_COLLAPSE = 25
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000 if os.uname().sysname == "Linux" else 0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_FAILED = ctypes.c_void_p(-1).value


def aligned_reservation(length: int) -> tuple[int, int] | None:
    """(start of the reservation, a HUGE-aligned address in it with `length` bytes after);
    None when the address space cannot be reserved. Release with `release(start, length)`."""
    base = _libc.mmap(None, length + HUGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if base in (None, _FAILED):
        return None
    return base, (base + HUGE - 1) & ~(HUGE - 1)


def release(base: int, length: int) -> None:
    _libc.munmap(base, length + HUGE)


def collapse(fd: int, start: int, stop: int) -> bool:
    """Back the file's bytes [start, stop) (HUGE-aligned, within the file) with huge pages."""
    length = stop - start
    if length <= 0 or start % HUGE or length % HUGE:
        return False
    reserved = aligned_reservation(length)
    if reserved is None:
        return False
    base, at = reserved
    try:
        if _libc.mmap(at, length, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, start) != at:
            return False
        return _libc.madvise(at, length, _MADV_COLLAPSE) == 0
    finally:
        release(base, length)
