"""`BlockCache`: dmdask's state on one worker, its block loads (`load`, the body of the
`load_block` task) and row serving (`serve`, for the handlers of `dmdask.worker.plugin`)."""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import distributed
import numpy as np

from ..arrivals import Arrivals
from ..internals import run_next
from ..protocol.worker import Moved
from .filling import FillingBlock
from .handover import GIVEN_SECONDS, ROWS, Handovers
from .holdings import (Arrays, Block, FileBlock, GroupHeld, Holding, Streamed, arrays_nbytes, concat,
                       payload_bytes)
from .read_ahead import ReadAhead
from .reads import LAST, PriorityPool
from .stream import StreamBuffer
from .tiers import TieredStore

logger = logging.getLogger(__name__)


class StoreCounters:
    """This worker's reads from the shared store (blocks, decoded bytes, transient-error retries)."""

    def __init__(self):
        self.requests = 0
        self.bytes = 0
        self.retries = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int, retries: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes
            self.retries += retries

    def retried(self, exc: BaseException) -> None:
        with self._lock:
            self.retries += 1


class BlockCache:
    """dmdask's state on one worker: tiers, read and transform threads, stream buffer, counters."""

    def __init__(self, worker: distributed.Worker, store: TieredStore, stream_buffer: int,
                 read_threads: int = 16, transform_threads: int = 2, read_ahead: bool = True):
        self.worker = worker
        self.store = store
        # pools of their own: a slow transform never holds up reads, nor either Dask's executor
        self.reads = PriorityPool(read_threads, "dmdask-read")
        self.ahead = ReadAhead(self)  # rows of `FillingBlock`s read while no rank's read waits
        self.reads.on_idle = self.ahead.wake
        if not read_ahead:
            self.ahead.close()
        self.transforms = ThreadPoolExecutor(transform_threads, thread_name_prefix="dmdask-transform")
        self.store_reads = StoreCounters()
        self.stream = StreamBuffer(stream_buffer, self.read, self.reads)
        self.streamed_hits = 0  # samples served from blocks streamed from the store
        self.rows_given = 0  # rows ranks read from the store and gave this worker (`receive`)
        self.peer_bytes_out = 0
        self.peer_bytes_in = 0
        self.peer_requests = 0  # requests answered on the row channel (`RowServer`)
        self.handovers = Handovers()  # what ranks and readers read from the store and handed over
        self.arrivals = Arrivals()  # requests waiting for load tasks of this worker
        store.on_block = self._arrived
        self._rereads: dict[str, asyncio.Future] = {}  # key -> (block, value) being read again (`_reread`)

    def read(self, reader) -> Block:
        """The block, read from the store, or as a reader handed it over (read from the
        store by that reader for this block: counted as this worker's store read)."""
        content = self.handovers.take(reader.key, getattr(reader, "claim", None))
        if reader.row_granular and reader.rank_rows and content is None:
            arrays, given = self._read_with_given(reader)
        else:
            given = None
            arrays = reader.decode(content) if content is not None else reader.read(on_retry=self.store_reads.retried)
        block = Block(arrays, reader.start, reader.stop)
        self.store_reads.add(block.nbytes - (0 if given is None else arrays_nbytes(given)))  # `receive` counts those
        return block

    def _read_with_given(self, reader) -> tuple[Arrays, Arrays | None]:
        """(A block read whole, the arrays of the rows in it that the opening rank read and
        gave, or None). Those rows are not read here but waited for, up to `GIVEN_SECONDS`,
        then read (the rank failed or is slow)."""
        n = reader.stop - reader.start
        theirs = np.asarray(reader.rank_rows, dtype=np.int64)
        ours = np.setdiff1d(np.arange(n), theirs)
        parts = [(ours, reader.read_rows(ours, on_retry=self.store_reads.retried))] if len(ours) else []
        given = self.handovers.take(reader.key, reader.claim, GIVEN_SECONDS, ROWS)
        if given is None or not np.array_equal(given[0], theirs):
            given = None
            parts.append((theirs, reader.read_rows(theirs, on_retry=self.store_reads.retried)))
        else:
            parts.append(given)
        rows = np.concatenate([r for r, _ in parts])
        order = np.argsort(rows, kind="stable")
        return {f: concat([a[f] for _, a in parts])[order] for f in parts[0][1]}, None if given is None else given[1]

    def read_rows(self, reader, rows) -> Arrays:
        arrays = reader.read_rows(rows, on_retry=self.store_reads.retried)
        self.store_reads.add(payload_bytes(arrays))
        return arrays

    def load(self, reader):
        """Body of the `load_block` task: read once, keep in the fastest tier with room
        (reserved before the read when the block's size is known, else charged after)."""
        if reader.row_granular:  # its rows are read when ranks ask: have the store's filesystem ready
            self.reads.submit(reader.prepare)
        if reader.nbytes is None:
            return self._load_unsized(reader)
        tier = self.store.reserve(reader.nbytes)
        if tier is None:
            self.handovers.take(reader.key, getattr(reader, "claim", None))  # no room: later reads stream them
            return Streamed(reader)
        if tier == "ram" and reader.row_granular:  # filled sample by sample as ranks ask, or ahead
            return self.store.place(reader.key, tier, FillingBlock(reader), reader.nbytes)
        try:
            block = self.read(reader)
        except BaseException:
            self.store.unreserve(tier, reader.nbytes)
            raise
        return self._place(reader, tier, block, reader.nbytes)

    def load_group(self, readers) -> GroupHeld:
        """Body of the `load_group` task: each block loaded as `load` loads it, at once in the
        worker's read threads (a store's latency paid once per group, not per block), and
        kept under its own key (where ranks and peers find it); the group's value names
        them. If one fails, every block of the group is let go (its room freed) and the
        first error raised."""
        loads = [self.reads.submit(self.load, reader) for reader in readers]
        kept: list[str] = []
        error: BaseException | None = None
        for reader, load in zip(readers, loads):
            try:
                self.store[reader.key] = load.result()
                kept.append(reader.key)
            except BaseException as exc:  # noqa: BLE001 - raised once every load ended
                error = error or exc
        if error is not None:
            for key in kept:
                self.store.pop(key, None)
            raise error
        return GroupHeld(kept)

    def _load_unsized(self, reader):
        if reader.row_granular and self.store.has_room("ram"):  # charged sample by sample as ranks ask
            return self.store.place(reader.key, "ram", FillingBlock(reader, sized=False), 0)
        if reader.row_granular and not self.store.has_room("ssd"):  # streamed file by file when asked
            return Streamed(reader)
        block = self.read(reader)
        tier = self.store.reserve(block.nbytes)
        if tier is None:
            return self._streamed(reader, block)
        return self._place(reader, tier, block, block.nbytes)

    def _place(self, reader, tier: str, block: Block, reserved: int):
        value = self.store.place(reader.key, tier, block, reserved, reader)
        return self._streamed(reader, block) if value is None else value  # None: the SSD refused the write

    def _streamed(self, reader, block: Block) -> Streamed:
        """The marker of a block read and kept in no tier; a whole block stays in the
        stream buffer for this epoch."""
        if not reader.row_granular:
            self.worker.loop.add_callback(self.stream.put, reader.key, block)
        return Streamed(reader)

    async def take(self, key: str, rows: np.ndarray, priority: float = LAST) -> tuple[Arrays, int]:
        """(rows of a block this worker holds, how many were read from the store for this
        request); KeyError if it holds no such block, ValueError (`check_rows`) unless
        `rows` are offsets inside the block. Its reads run at `priority` (`PriorityPool`)."""
        value = self.store[key]
        if not isinstance(value, Holding):
            raise KeyError(key)
        rows = check_rows(key, rows, len(value))
        if key in self._rereads:  # its files failed and it is being read again: wait for that read
            block, _ = await asyncio.shield(self._rereads[key])
            self.streamed_hits += len(rows)
            return block.take(rows), len(rows)
        try:
            out, read = await value.serve(rows, self, priority)
        except OSError as exc:  # its files were deleted or cannot be read
            if not value.rereadable:
                raise
            if self.store.get(key) is value:  # the first request to find out
                self._reread(key, value, exc)
            return await self.take(key, rows, priority)  # from the block read again
        self.streamed_hits += read
        if len(rows) > read:
            self.store.count_hit(value.tier, len(rows) - read, payload_bytes(out) * (len(rows) - read) // len(rows))
        return out, read

    def in_thread(self, priority: float, fn, *args) -> asyncio.Future:
        """`fn(*args)` in a read thread, the earliest batch's reads first (`PriorityPool`)."""
        return asyncio.wrap_future(self.reads.submit_at(priority, fn, *args))

    def _arrived(self, key: str) -> None:
        """A block was stored (from any thread): wake the requests waiting for it, on the
        loop, so also a request that found it missing just before it was stored."""
        self.worker.loop.add_callback(self.arrivals.wake, key)  # thread-safe

    def _reread(self, key: str, broken: FileBlock, exc: OSError) -> None:
        """Drop a block whose files cannot be read (counted in `read_errors`, logged) and
        read it again from the store, once: requests for it wait for that read, and the
        block goes back into the fastest tier with room (else it is streamed). A failed
        read (`BlockReadError`) fails the waiting requests and leaves the block streamed."""
        reader = broken.reader
        self.store.count_read_error(broken.tier)
        logger.warning("cannot read block %s from its %s files in %s (%s: %s); reading it again from %s",
                       key, broken.tier, broken.path, type(exc).__name__, exc, reader.url)
        marker = Streamed(reader)
        self.store[key] = marker  # frees the tier's room and removes what is left of the files
        pending = self._rereads[key] = asyncio.wrap_future(self.reads.submit_at(0, self._read_and_place, reader))

        def done(fut):
            del self._rereads[key]
            if not fut.cancelled() and fut.exception() is None and self.store.get(key) is marker:
                self.store[key] = fut.result()[1]

        pending.add_done_callback(done)

    def _read_and_place(self, reader):
        """In a read thread: (the block read from the store, what to hold under its key)."""
        block = self.read(reader)
        tier = self.store.reserve(block.nbytes)
        return block, Streamed(reader) if tier is None else self._place(reader, tier, block, block.nbytes)

    async def serve(self, requests: dict[str, np.ndarray], priority: float = LAST,
                    wait: float = 0.0) -> tuple[Arrays, int]:
        """(the rows of several held blocks, one array per field in request order; how
        many were read from the store for this request). A block whose load task this
        worker has is waited for, up to `wait` seconds (a rank sent here by
        `locate(planned=True)` needs no round trip through the scheduler); `Moved` names
        those not held then."""
        missing = await self._missing(list(requests), wait, priority)
        if missing:
            raise Moved(missing)
        taken = await asyncio.gather(*(self.take(key, rows, priority) for key, rows in requests.items()))
        parts = [arrays for arrays, _ in taken]
        return ({f: concat([p[f] for p in parts]) for f in parts[0]} if parts else {}), sum(n for _, n in taken)

    async def _missing(self, keys: list[str], wait: float, priority: float = 0) -> list[str]:
        """The keys not held once those whose load task this worker has are waited for, up
        to `wait` seconds. A rank waits for them now: their loads still queued here run
        next, ahead of the loads no rank asked for yet (earlier batches' first: `priority`),
        so a rank's first batches never wait behind the rest of the dataset's loads."""
        missing = [key for key in keys if key not in self.store]
        tasks = self.worker.state.tasks
        coming = [k for k in missing if k in tasks and tasks[k].state in LOADING_STATES]
        if coming and wait > 0:
            run_next(self.worker.state, coming, priority)  # queued only while every thread is busy
            await self.arrivals.wait(coming, wait)
            missing = [key for key in keys if key not in self.store]
        return missing

    async def receive(self, rows: dict[str, np.ndarray], arrays: dict[str, Arrays], claim: str,
                      retries: int = 0, wait: float = 0.0) -> tuple[list[str], list[str]]:
        """Take rows the rank that opened their dataset read from the store itself
        (`dmdask.client.first_batch`): a block filled sample by sample keeps them (one loading
        is waited for, up to `wait` seconds), a block being read whole takes them instead of
        reading them (`Handovers`); (the keys of the blocks that took any, those not held
        once waited for: a load that failed or is slow). Only the rows its
        reader names with `claim` (`rank_rows`, the reader's `claim`); others are let go. Counted as
        this worker's, for the blocks it holds: the store reads (with their `retries`) and
        the rows served from the store (stream hits)."""
        kept = {key: self.handovers.put(key, claim, (wanted, arrays[key]), wanted.nbytes + arrays_nbytes(arrays[key]),
                                        GIVEN_SECONDS, ROWS) for key, wanted in rows.items()}
        missing = set(await self._missing(list(rows), wait))
        taken = []
        for key, wanted in rows.items():
            # None: a whole read took them; not kept (no room): a whole read reads them itself
            found = self.handovers.take(key, claim, kind=ROWS) if kept[key] else (wanted, arrays[key])
            if key in missing:
                continue
            block = self.store.get(key)
            if found is None or (isinstance(block, FillingBlock) and block.receive(*found, claim, self)):
                taken.append(key)
            # counted as the read they stand for counts: a whole block's or a filling block's rows
            self.store_reads.add((arrays_nbytes if found is None else payload_bytes)(arrays[key]), retries)
            self.rows_given += len(wanted)
            self.streamed_hits += len(wanted)
            retries = 0  # counted once
        return taken, sorted(missing)

    def close(self) -> None:
        self.ahead.close()
        self.reads.shutdown(wait=False, cancel_futures=True)
        self.transforms.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        """The worker's `dmdask` metric and `dmdask.stats`: its tiers' and the cache's counters."""
        return {**self.store.stats(),
                "stream": {"hits": self.streamed_hits, "buffer_bytes": self.stream.bytes,
                           "buffer_capacity": self.stream.capacity},
                "shared_store": {"requests": self.store_reads.requests, "bytes": self.store_reads.bytes,
                                 "retries": self.store_reads.retries, "read_ahead": self.ahead.rows_read,
                                 "from_ranks": self.rows_given},
                "peer": {"bytes_out": self.peer_bytes_out, "bytes_in": self.peer_bytes_in,
                         "requests": self.peer_requests}}


NO_COUNTS = {"stream": {"hits": 0, "buffer_bytes": 0, "buffer_capacity": 0},  # `stats` before a cache starts
             "shared_store": {"requests": 0, "bytes": 0, "retries": 0, "read_ahead": 0, "from_ranks": 0},
             "peer": {"bytes_out": 0, "bytes_in": 0, "requests": 0}}


LOADING_STATES = frozenset({"waiting", "ready", "constrained", "executing", "long-running"})


def check_rows(key: str, rows, length: int) -> np.ndarray:
    """`rows` as an int64 array when it holds offsets in 0..length-1 (not negative ones,
    which numpy takes from the end); otherwise ValueError naming block `key` and them."""
    rows = np.asarray(rows)
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise ValueError(f"rows of block {key} must be a 1-d array of integer offsets, "
                         f"got {rows.dtype} of shape {rows.shape}")
    bad = np.unique(rows[(rows < 0) | (rows >= length)])
    if len(bad):
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise ValueError(f"rows of block {key} must be offsets in 0..{length - 1}; "
                         f"got {bad[:8].tolist()}{more}")
    return rows.astype(np.int64, copy=False)

