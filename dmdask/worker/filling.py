"""`FillingBlock`: a RAM block of a one-file-per-sample source, filled as ranks ask (and
read ahead: `dmdask.worker.read_ahead`)."""
from __future__ import annotations

import asyncio

import numpy as np

from ..shm.fileblocks import Arrays
from .holdings import Block, Holding, concat
from .reads import LAST


class FillingBlock(Holding):
    """Each sample is read from the store the first time a rank wants it, or ahead of it, and kept.
    `sized`: the block's room was reserved at creation; otherwise (an HTTP folder lists no
    sizes) each sample is charged to the tier when read, and those it has no room for are
    served and not kept. Used from the worker's event loop."""

    __slots__ = ("arrays", "have", "jobs", "nbytes", "reader", "reading", "samples", "sized", "start", "stop")

    def __init__(self, reader, sized: bool = True):
        n = reader.stop - reader.start
        self.reader = reader
        self.arrays = None  # field -> array, made on the first fill
        self.have = np.zeros(n, dtype=bool)
        self.sized = sized
        self.nbytes = reader.nbytes if sized else 0
        self.samples = n if sized else 0  # samples charged to the tier
        self.start, self.stop = reader.start, reader.stop
        self.reading: dict[int, asyncio.Future] = {}  # row -> the read under way that brings it
        self.jobs: dict[asyncio.Future, object] = {}  # a read under way -> its call in the read threads

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

    async def serve(self, rows: np.ndarray, cache, priority: float) -> tuple[Arrays, int]:
        """Rows not held yet are read now, at `priority`, unless a read under way for
        another request brings them: then that read is awaited, hastened to `priority` if
        still queued, so each row is read once and a request waits only for the reads of
        its own rows, none of them queued behind later batches' reads."""
        missing = np.unique(rows[~self.have[rows]])
        under_way = {id(f): f for f in map(self.reading.get, missing.tolist()) if f is not None}
        mine = np.array([r for r in missing.tolist() if r not in self.reading], dtype=np.int64)
        reads = list(under_way.values())
        for read in reads:
            if read in self.jobs:
                cache.reads.hasten(self.jobs[read], priority)
        if len(mine):
            reads.append(self._start_read(mine, cache, priority))  # not cancelled with this request
        spares = [await asyncio.shield(read) for read in reads]
        for r in missing.tolist():  # rows read ahead and not kept: served once, then let go
            if r in self.reading and self.reading[r].done():
                del self.reading[r]
        if not spares:
            return self.take(rows), 0
        spare_rows = np.concatenate([r for r, _ in spares])
        order = np.argsort(spare_rows, kind="stable")
        spare = {f: concat([a[f] for _, a in spares])[order] for f in spares[0][1]}
        return self.take(rows, spare_rows[order], spare), len(mine)

    def unread(self, limit: int) -> np.ndarray:
        """Up to `limit` of the first rows neither held, nor being read, nor read by a rank
        that hands them over (`reader.rank_rows`)."""
        free = ~self.have
        if self.reader.rank_rows:
            free[list(self.reader.rank_rows)] = False
        if self.reading:
            free[list(self.reading)] = False
        return np.flatnonzero(free)[:limit]

    def read_ahead(self, rows: np.ndarray, cache) -> asyncio.Future:
        """Read `rows` (from `unread`) before any rank asks, at the lowest priority; a request
        for them meanwhile waits for this read. Rows the tier has no room for stay with the
        read until a request takes them. The read's future: (rows, their arrays)."""
        return self._start_read(rows, cache, LAST, ahead=True)

    def _start_read(self, rows: np.ndarray, cache, priority: float, ahead: bool = False) -> asyncio.Future:
        """The future of `_fill(rows)`, its read queued in the read threads at `priority`."""
        job = cache.reads.submit_at(priority, cache.read_rows, self.reader, rows)
        read = asyncio.ensure_future(self._fill(rows, cache, asyncio.wrap_future(job), ahead))
        self.jobs[read] = job
        read.add_done_callback(self._forget_job)
        for r in rows.tolist():
            self.reading[r] = read
        return read

    def _forget_job(self, read: asyncio.Future) -> None:
        self.jobs.pop(read, None)

    async def _fill(self, rows: np.ndarray, cache, job: asyncio.Future, ahead: bool = False):
        """Read `rows` (increasing) from the store (`job`) and keep those the tier has room for;
        (rows, their arrays), kept or not. Those not kept stay in `reading` when read ahead."""
        kept, done = 0, False
        try:
            arrays = await job
            kept = self._keep(rows, arrays, cache)
            done = True
            return rows, arrays
        finally:
            for r in (rows[:kept] if ahead and done else rows).tolist():
                self.reading.pop(r, None)

    def _keep(self, rows: np.ndarray, arrays: Arrays, cache) -> int:
        """Fill `rows` with `arrays`, the first of them the tier has room for; how many."""
        kept = len(rows)
        if not self.sized:
            sizes = sample_nbytes(arrays)
            kept = cache.store.charge("ram", sizes)
            self.samples += kept
            self.nbytes += int(sizes[:kept].sum())
        self.fill(rows[:kept], {f: a[:kept] for f, a in arrays.items()})
        return kept

    def receive(self, rows: np.ndarray, arrays: Arrays, claim: str, cache) -> int:
        """Keep rows the opening rank read from the store: those its reader names with
        `claim` (`rank_rows`, the reader's `claim`) that are neither held nor being read, as far as
        the tier has room; how many were kept (no rank of this epoch asks for the others:
        let go)."""
        if claim != self.reader.claim:
            return 0
        new = np.isin(rows, self.reader.rank_rows)
        new[new] = ~self.have[rows[new]]
        if self.reading:
            new &= np.array([r not in self.reading for r in rows.tolist()], dtype=bool)
        order = np.argsort(rows[new], kind="stable")
        return self._keep(rows[new][order], {f: a[new][order] for f, a in arrays.items()}, cache)

    def __reduce__(self):
        # Leaving the worker (a graceful retirement): travel as a complete block.
        arrays = self.arrays if self.have.all() else self.reader.read()
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
