"""`ReadAhead`: the store kept busy while no rank waits. The rows of this worker's
`FillingBlock`s are read when ranks ask; whenever none of those reads is queued or running
(`PriorityPool.idle`: the epoch's start, a rank paused by a garbage collection or its
training step), rows nobody asked for yet are read instead, at the lowest priority, block
by block in the order the blocks arrived (the order the epoch first needs them).

Guarantees: each row is still read from the store once in an epoch (a request for a row
being read ahead waits for that read, `FillingBlock.serve`); a row read ahead is kept, or,
in a block of unknown size whose tier ran out of room meanwhile, held until a request
takes it (blocks of unknown size are read ahead only while their tier takes samples); at
most `IN_FLIGHT` reads ahead at a time; nothing is read for a block the worker no longer
holds. A read ahead that fails leaves its block to the ranks' own reads.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

from .filling import FillingBlock

logger = logging.getLogger(__name__)
ROWS = 8  # rows a read ahead (one file each, fetched concurrently)
IN_FLIGHT = 2  # reads ahead at a time


class ReadAhead:
    """Reads ahead for one worker's `BlockCache` (`cache`). Used from the worker's event
    loop; `wake` is thread-safe."""

    def __init__(self, cache):
        self.cache = cache
        self.rows_read = 0  # rows read ahead (`BlockCache.stats`)
        self._blocks: deque[tuple[str, FillingBlock]] = deque()
        self._running = 0
        self._closed = False

    def __len__(self) -> int:
        """Blocks in line to be read ahead (some may be complete, or gone: a released
        dataset's are let go as reading ahead reaches them, when the next read ends)."""
        return len(self._blocks)

    @property
    def running(self) -> int:
        """Reads ahead under way."""
        return self._running

    def add(self, key: str, block: FillingBlock) -> None:
        """`block`, stored under `key`, is to be read ahead after those added before it (once closed: not)."""
        if not self._closed:
            self._blocks.append((key, block))
            self.poke()

    def wake(self) -> None:
        """From any thread: look for reads ahead to start (the ranks' reads just ended)."""
        if self._blocks and not self._closed:
            self.cache.worker.loop.add_callback(self.poke)

    def poke(self) -> None:
        """Start reads ahead while no rank's read is queued or running, up to `IN_FLIGHT`."""
        while not self._closed and self._running < IN_FLIGHT and self.cache.reads.idle():
            job = self._next()
            if job is None:
                return
            key, block, rows = job
            self._running += 1
            read = block.read_ahead(rows, self.cache)
            read.add_done_callback(lambda done, key=key, n=len(rows): self._done(done, key, n))

    def _next(self):
        """(key, block, rows) of the next read ahead, or None."""
        while self._blocks:
            key, block = self._blocks[0]
            rows = block.unread(ROWS) if self.cache.store.get(key) is block else ()
            if not len(rows):  # complete, all under way, or gone
                self._blocks.popleft()
                continue
            if not block.sized and not self.cache.store.room_to_charge("ram"):
                self._blocks.popleft()  # the tier takes no more samples: left to the ranks
                continue
            return key, block, rows
        return None

    def _done(self, read: asyncio.Future, key: str, rows: int) -> None:
        self._running -= 1
        if read.cancelled() or read.exception() is not None:
            logger.debug("reading ahead in block %s failed (%r); its rows are left to the ranks' reads", key,
                         None if read.cancelled() else read.exception())
            self._blocks = deque(entry for entry in self._blocks if entry[0] != key)
        else:
            self.rows_read += rows
        self.poke()

    def close(self) -> None:
        """No more reads ahead (those under way end on their own)."""
        self._closed = True
        self._blocks.clear()
