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
import weakref

from .libc import FAILED, MADV_COLLAPSE, MAP_FIXED, MAP_NORESERVE, libc

HUGE = 2 << 20  # bytes of a PMD-mapped huge page on x86-64 and arm64 (4 KiB base pages)


def aligned_reservation(length: int) -> tuple[int, int] | None:
    """(start of the reservation, a HUGE-aligned address in it with `length` bytes after);
    None when the address space cannot be reserved. Release with `release(start, length)`."""
    base = libc.mmap(None, length + HUGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if base in (None, FAILED):
        return None
    return base, (base + HUGE - 1) & ~(HUGE - 1)


def release(base: int, length: int) -> None:
    libc.munmap(base, length + HUGE)


def map_read_only(fd: int, length: int):
    """The file's first `length` bytes mapped read-only at a HUGE-aligned address, so that
    extents the page cache holds as huge pages (`collapse`) are mapped by huge-page TLB
    entries (an address the kernel picks is 4 KiB-aligned: every page its own entry); a
    ctypes char array over them, unmapped once it is garbage collected; None when the
    address space cannot be reserved or the file not mapped."""
    reserved = aligned_reservation(length)
    if reserved is None:
        return None
    base, at = reserved
    if libc.mmap(at, length, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, 0) != at:
        release(base, length)
        return None
    memory = (ctypes.c_char * length).from_address(at)
    weakref.finalize(memory, release, base, length)
    return memory


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
        if libc.mmap(at, length, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, start) != at:
            return False
        return libc.madvise(at, length, MADV_COLLAPSE) == 0
    finally:
        release(base, length)
