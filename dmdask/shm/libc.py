"""The C library's memory calls that Python's `mmap` module lacks (a mapping at a fixed
address, madvise with the GIL released), declared once."""
from __future__ import annotations

import ctypes
import mmap
import sys

PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10
LINUX = sys.platform.startswith("linux")
MAP_NORESERVE = 0x4000 if LINUX else 0
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in as if written, contents unchanged
MADV_COLLAPSE = 25  # Linux >= 6.1: back a range with transparent huge pages now

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
FAILED = ctypes.c_void_p(-1).value


def populate(address: int, length: int) -> bool:
    """Fault in the pages of [address, address + length) of a writable mapping now, leaving
    their bytes as they are (safe while another thread writes them); False where the kernel
    cannot (older than 5.14, not writable)."""
    if not LINUX:  # the advice's number means another thing elsewhere
        return False
    start = address - address % PAGE
    return libc.madvise(start, length + address - start, MADV_POPULATE_WRITE) == 0
