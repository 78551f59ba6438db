"""Memory for warm batches, reused once a batch is dropped (fresh memory would fault its
pages in again for every batch): a chunk of a long-lived slab of private anonymous memory
(huge pages where allowed) per batch, back in its pool when the last array viewing it is
collected, never before; beyond `MAX_POOL_BYTES`, ordinary memory. The arrays are ordinary
writable numpy arrays (torch.from_numpy shares them).
"""
from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import weakref

import numpy as np

from .libc import populate_soon

MAX_POOL_BYTES = 512 << 20  # per batch layout and process
SLAB_CHUNKS = 8  # chunks added to a pool at a time
AHEAD = 1  # chunks next in line faulted in ahead of their first use, by another thread
# (a pool zeroes at most this many chunks it never uses)
_ALIGN = 64

Layout = tuple[tuple[str, str, tuple], ...]  # (field, dtype, row shape) ...


class _Pool:
    """Chunks of one size, carved from slabs of anonymous memory."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.max_chunks = MAX_POOL_BYTES // chunk_bytes
        self._slabs: list[mmap.mmap] = []
        self._addresses: list[int] = []  # of each slab
        self._free: list[tuple[int, int]] = []  # (slab, chunk)
        self._touched: set[tuple[int, int]] = set()  # chunks used or faulted in ahead
        self._lock = threading.Lock()
        # chunks given back, taken into `_free` under the lock by `take`: a finalizer gives a
        # chunk back whenever the collector runs, in any thread, `take`'s own under its lock
        # included (a lock there deadlocked a thread on itself); deque appends are atomic
        self._returned: collections.deque[tuple[int, int]] = collections.deque()

    def take(self):
        """A ctypes array over a free chunk, or None when the pool is exhausted. The next
        chunks never used yet are faulted in meanwhile (a first touch of fresh memory costs
        more than the copy into it), so only a pool's first chunk is faulted in by its user."""
        with self._lock:
            while self._returned:
                self._free.append(self._returned.popleft())
            if not self._free and len(self._slabs) * SLAB_CHUNKS < self.max_chunks:
                slab = mmap.mmap(-1, self.chunk_bytes * SLAB_CHUNKS, flags=mmap.MAP_PRIVATE)
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    slab.madvise(mmap.MADV_HUGEPAGE)
                self._slabs.append(slab)
                self._addresses.append(ctypes.addressof(ctypes.c_char.from_buffer(slab)))
                self._free.extend((len(self._slabs) - 1, c) for c in reversed(range(SLAB_CHUNKS)))
            if not self._free:
                return None
            slab, chunk = self._free.pop()
            ahead = [c for c in self._free[len(self._free) - AHEAD:] if c not in self._touched]
            self._touched.update(ahead + [(slab, chunk)])
        for s, c in ahead:
            populate_soon(self._addresses[s] + c * self.chunk_bytes, self.chunk_bytes)
        holder = (ctypes.c_char * self.chunk_bytes).from_buffer(self._slabs[slab], chunk * self.chunk_bytes)
        weakref.finalize(holder, self._give_back, slab, chunk)
        return holder

    def _give_back(self, slab: int, chunk: int) -> None:
        """From a finalizer, in any thread at any time: no lock (see `_returned`)."""
        self._returned.append((slab, chunk))


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def empty_batch(layout: Layout, rows: int) -> dict[str, np.ndarray]:
    """Uninitialised arrays of `rows` rows, one per field of `layout`, in pooled memory."""
    nbytes = [rows * np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)) for _, dtype, shape in layout]
    total = sum(_aligned(n) for n in nbytes)
    if total * SLAB_CHUNKS > MAX_POOL_BYTES:
        return _plain(layout, rows)
    with _pools_lock:
        pool = _pools.get(total)
        if pool is None:
            pool = _pools[total] = _Pool(total)
    holder = pool.take()
    if holder is None:
        return _plain(layout, rows)
    memory = np.frombuffer(holder, dtype=np.uint8)
    out, at = {}, 0
    for (name, dtype, shape), size in zip(layout, nbytes):
        out[name] = memory[at:at + size].view(dtype).reshape((rows,) + tuple(shape))
        at += _aligned(size)
    return out


def _plain(layout: Layout, rows: int) -> dict[str, np.ndarray]:
    return {name: np.empty((rows,) + tuple(shape), dtype=dtype) for name, dtype, shape in layout}
