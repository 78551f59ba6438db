"""The C library's memory calls that Python's `mmap` module lacks (a mapping at a fixed
address, madvise with the GIL released), declared once; pages faulted in ahead of use by a
thread of their own (`populate_soon`)."""
from __future__ import annotations

import ctypes
import mmap
import sys

from ..threads import ForkSafeExecutor

PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10
LINUX = sys.platform.startswith("linux")
MAP_NORESERVE = 0x4000 if LINUX else 0
MADV_POPULATE_READ = 22  # Linux >= 5.14: fault pages in as if read
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in as if written, contents unchanged
MADV_COLLAPSE = 25  # Linux >= 6.1: back a range with transparent huge pages now

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
FAILED = ctypes.c_void_p(-1).value


def populate(address: int, length: int, write: bool = True) -> bool:
    """Fault in the pages of [address, address + length) of a mapping now, as if written
    (a writable mapping) or read, leaving their bytes as they are (safe while another thread
    uses them); False where the kernel cannot (older than 5.14, not writable, unmapped)."""
    if not LINUX:  # the advice's number means another thing elsewhere
        return False
    start = address - address % PAGE
    return libc.madvise(start, length + address - start, MADV_POPULATE_WRITE if write else MADV_POPULATE_READ) == 0


_populator = ForkSafeExecutor(1, "dmdask-populate")


def populate_soon(address: int, length: int, write: bool = True):
    """`populate` by a thread of its own, after those asked before; returns at once (a
    future of its result). The caller keeps the range mapped, or lets the call fail."""
    return _populator.submit(populate, address, length, write)
