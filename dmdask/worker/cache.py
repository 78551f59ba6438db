"""`BlockCache`: dmdask's state on one worker, its block loads and its two RPC handlers.

- `load_block` (a Dask task, one per block, stable key): reads the block from the
  shared store once and admits it into the fastest tier with room, or leaves a
  `Streamed` marker when no tier has room. Its future is the block's cache entry.
- `dmdask_rows` (RPC): serves rows of the blocks this worker holds, to itself or to a
  peer. Rows of a streamed block come straight from the store when it holds one file
  per sample; otherwise the block goes through a small `StreamBuffer`, read once while
  the ranks take their rows of it.
- `dmdask_hand_over` (RPC, transparent mode): bytes of blocks a reader already read
  from the store, taken by their load tasks in place of a store read (`handover`).
- `dmdask_batch` (RPC, called by a rank on its own node): gathers one batch's rows from
  the holders (itself without a copy, peers over Dask's comms), puts them in batch
  order, runs the spec's transform and returns the batches: to a trainer on its own
  host through a file in shared memory (`dmdask.shm.results`), to others over TCP.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Tuple

import distributed
import numpy as np
from distributed.comm.core import CommClosedError
from distributed.protocol.serialize import to_serialize

from .. import arguments as check
from ..shm.results import shareable, write_batches
from ..spec import TransformContext, loads_transform
from .handover import Handovers
from .reads import LAST, PriorityPool
from .holdings import ArenaBlock, Arrays, Block, FileBlock, FillingBlock, Streamed, sample_nbytes
from .stream import StreamBuffer
from .tiers import TieredStore
from .transforms import transform_in_order, transform_isolated

logger = logging.getLogger(__name__)


class StoreCounters:
    """Reads from the shared store made by this worker (blocks and decoded bytes), and
    the retries of reads that met a transient error."""

    def __init__(self):
        self.requests = 0
        self.bytes = 0
        self.retries = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes

    def retried(self, exc: BaseException) -> None:
        with self._lock:
            self.retries += 1


class BlockCache:
    """dmdask's state on one worker: tiers, stream buffer, counters and handlers (registered here)."""

    def __init__(self, worker: distributed.Worker, store: TieredStore, stream_buffer: int,
                 read_threads: int = 16, transform_threads: int = 2):
        self.worker = worker
        self.store = store
        # Two pools of their own: one job's slow transform never holds up another's reads
        # (and neither waits behind Dask's or other extensions' use of the default executor).
        self.reads = PriorityPool(read_threads, "dmdask-read")  # the earliest batch's reads first
        self.transforms = ThreadPoolExecutor(transform_threads, thread_name_prefix="dmdask-transform")
        self.store_reads = StoreCounters()
        self.stream = StreamBuffer(stream_buffer, self.read, self.reads)
        self.streamed_hits = 0  # samples served from blocks streamed from the store
        self.peer_bytes_out = 0
        self.peer_bytes_in = 0
        self.handovers = Handovers()
        self._arrivals: Dict[str, list] = {}  # key -> futures of requests waiting for its load task
        store.on_block = self._arrived
        self._rereads: Dict[str, asyncio.Future] = {}  # key -> (block, value) being read again (`_reread`)
        worker.handlers["dmdask_rows"] = self.rows_handler
        worker.handlers["dmdask_batch"] = self.batch_handler
        worker.handlers["dmdask_describe"] = self.describe_handler
        worker.handlers["dmdask_count_hits"] = self.count_hits_handler
        worker.handlers["dmdask_hand_over"] = self.hand_over_handler
        worker.metrics["dmdask"] = lambda worker: self.stats()

    # -- reading from the shared store -------------------------------------------------
    def read(self, reader) -> Block:
        """The block, read from the store, or as a reader handed it over (read from the
        store by that reader for this block: counted as this worker's store read)."""
        content = self.handovers.take(reader.key, getattr(reader, "claim", None))
        arrays = reader.decode(content) if content is not None else reader.read(on_retry=self.store_reads.retried)
        block = Block(arrays, reader.start, reader.stop)
        self.store_reads.add(block.nbytes)
        return block

    def hand_over_handler(self, blocks: Dict[str, bytes], claim: str = None) -> list:
        """Keep blocks' bytes for their load tasks of claim `claim` (`Handovers`); the keys
        kept (others had no room)."""
        check.mapping("dmdask_hand_over", "blocks", blocks)
        check.text("dmdask_hand_over", "claim", claim)
        wrong = [key for key, content in blocks.items() if not isinstance(content, (bytes, bytearray, memoryview))]
        if wrong:
            raise check.refuse("dmdask_hand_over", f"blocks[{wrong[0]!r}]", "bytes", type(blocks[wrong[0]]).__name__)
        return [key for key, content in blocks.items() if self.handovers.put(key, claim, content)]

    def read_rows(self, reader, rows) -> Arrays:
        arrays = reader.read_rows(rows, on_retry=self.store_reads.retried)
        self.store_reads.add(_nbytes(arrays))
        return arrays

    def load(self, reader):
        """Body of the `load_block` task: read once, keep in the fastest tier with room.

        Room is reserved before the read when the block's size is known; a block whose
        size only the read tells (an HTTP folder lists no sizes) is charged once read."""
        if reader.row_granular:  # its rows are read when ranks ask: have the store's filesystem ready
            self.reads.submit(reader.prepare)
        if reader.nbytes is None:
            return self._load_unsized(reader)
        tier = self.store.reserve(reader.nbytes)
        if tier is None:
            self.handovers.take(reader.key, getattr(reader, "claim", None))  # no room: later reads stream them
            return Streamed(reader)
        if tier == "ram" and reader.row_granular:  # filled sample by sample as ranks ask
            return self.store.place(reader.key, tier, FillingBlock(reader), reader.nbytes)
        try:
            block = self.read(reader)
        except BaseException:
            self.store.unreserve(tier, reader.nbytes)
            raise
        return self._place(reader, tier, block, reader.nbytes)

    def _load_unsized(self, reader):
        if reader.row_granular and self.store.has_room("ram"):  # charged sample by sample as ranks ask
            return self.store.place(reader.key, "ram", FillingBlock(reader, sized=False), 0)
        if reader.row_granular and not self.store.has_room("ssd"):  # streamed file by file when asked
            return Streamed(reader)
        block = self.read(reader)
        tier = self.store.reserve(block.nbytes)
        if tier is None:
            if not reader.row_granular:
                self.worker.loop.add_callback(self.stream.put, reader.key, block)
            return Streamed(reader)
        return self._place(reader, tier, block, block.nbytes)

    def _place(self, reader, tier: str, block: Block, reserved: int):
        value = self.store.place(reader.key, tier, block, reserved, reader)
        if value is None:  # the SSD refused the write: keep what was read for this epoch
            if not reader.row_granular:
                self.worker.loop.add_callback(self.stream.put, reader.key, block)
            return Streamed(reader)
        return value

    # -- serving rows ------------------------------------------------------------------
    async def take(self, key: str, rows: np.ndarray, priority: float = LAST) -> Tuple[Arrays, int]:
        """(rows of a block this worker holds, how many of them were read from the store
        for this request); KeyError if it holds no such block,
        ValueError naming the block and the bad offsets (before anything is read) unless
        `rows` are offsets inside the block. Reads it needs run at `priority` (lower
        first: the position of the batch that waits for them, `PriorityPool`)."""
        value = self.store[key]
        if isinstance(value, (Block, FillingBlock, FileBlock, ArenaBlock, Streamed)):
            rows = check_rows(key, rows, _length(value))
        if key in self._rereads:  # its files failed and it is being read again: wait for that read
            block, _ = await asyncio.shield(self._rereads[key])
            self.streamed_hits += len(rows)
            return block.take(rows), len(rows)
        if isinstance(value, Block):
            out = value.take(rows)
            tier = "ram"
        elif isinstance(value, FillingBlock):
            out, read = await self._take_filling(value, rows, priority)
            self.streamed_hits += read
            if len(rows) > read:
                self.store.count_hit("ram", len(rows) - read, _nbytes(out) * (len(rows) - read) // len(rows))
            return out, read
        elif isinstance(value, (FileBlock, ArenaBlock)):
            try:
                out = await asyncio.wrap_future(self.reads.submit_at(priority, value.take, rows))
            except OSError as exc:  # its files were deleted or cannot be read
                if not isinstance(value, FileBlock) or value.reader is None:
                    raise
                if self.store.get(key) is value:  # the first request to find out
                    self._reread(key, value, exc)
                return await self.take(key, rows, priority)  # from the block read again
            tier = value.tier
        elif isinstance(value, Streamed) and value.reader.row_granular:
            # one file per sample: read just these samples, nothing is held afterwards
            out = await asyncio.wrap_future(self.reads.submit_at(priority, self.read_rows, value.reader, rows))
            self.streamed_hits += len(rows)
            return out, len(rows)
        elif isinstance(value, Streamed):
            block = await self.stream.get(value.reader, priority)
            self.streamed_hits += len(rows)
            out = block.take(rows)
            self.stream.served(key, len(rows))
            return out, len(rows)
        else:
            raise KeyError(key)
        self.store.count_hit(tier, len(rows), _nbytes(out))
        return out, 0

    async def _take_filling(self, block: FillingBlock, rows: np.ndarray, priority: float):
        """(the rows of a filling block, how many of them this request read from the store).
        Rows not held yet are read now, at `priority`, unless a read under way for another
        request brings them: then that read is awaited, so each row is read once and a
        request waits only for the reads of its own rows."""
        missing = block.missing(rows)
        under_way = {id(f): f for f in map(block.reading.get, missing.tolist()) if f is not None}
        mine = np.array([r for r in missing.tolist() if r not in block.reading], dtype=np.int64)
        reads = list(under_way.values())
        if len(mine):
            read = asyncio.ensure_future(self._fill(block, mine, priority))  # not cancelled with this request
            for r in mine.tolist():
                block.reading[r] = read
            reads.append(read)
        spares = [await asyncio.shield(read) for read in reads]
        if not spares:
            return block.take(rows), 0
        spare_rows = np.concatenate([r for r, _ in spares])
        order = np.argsort(spare_rows, kind="stable")
        spare = {f: _concat([a[f] for _, a in spares])[order] for f in spares[0][1]}
        return block.take(rows, spare_rows[order], spare), len(mine)

    async def _fill(self, block: FillingBlock, rows: np.ndarray, priority: float):
        """Read `rows` (increasing) of a filling block from the store and keep those the
        tier has room for; (rows, their arrays), kept or not."""
        try:
            arrays = await asyncio.wrap_future(self.reads.submit_at(priority, self.read_rows, block.reader, rows))
            kept = len(rows)
            if not block.sized:
                sizes = sample_nbytes(arrays)
                kept = self.store.charge("ram", sizes)
                block.samples += kept
                block.nbytes += int(sizes[:kept].sum())
            block.fill(rows[:kept], {f: a[:kept] for f, a in arrays.items()})
            return rows, arrays
        finally:
            for r in rows.tolist():
                block.reading.pop(r, None)

    def _arrived(self, key: str) -> None:
        """A block was stored (from any thread): wake the requests waiting for it."""
        if key in self._arrivals:
            self.worker.loop.add_callback(self._wake, key)  # thread-safe

    def _wake(self, key: str) -> None:
        for fut in self._arrivals.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    async def _wait_for_loads(self, keys, seconds: float) -> None:
        """Wait up to `seconds` for those of `keys` whose load task this worker has (the
        scheduler sent it): a rank sent there by `locate(planned=True)` does not wait for
        a round trip through the scheduler once the block is in."""
        tasks = self.worker.state.tasks
        coming = [k for k in keys if k in tasks and tasks[k].state in LOADING_STATES]
        if not coming:
            return
        waiters = []
        for key in coming:
            fut = asyncio.get_running_loop().create_future()
            self._arrivals.setdefault(key, []).append(fut)
            waiters.append(fut)
        done = [k for k in coming if k in self.store]  # stored between the check and now
        for key in done:
            self._wake(key)
        await asyncio.wait(waiters, timeout=seconds)
        for key, fut in zip(coming, waiters):
            if not fut.done():
                fut.cancel()
                left = [f for f in self._arrivals.get(key, ()) if f is not fut]
                if left:
                    self._arrivals[key] = left
                else:
                    self._arrivals.pop(key, None)

    def _reread(self, key: str, broken: FileBlock, exc: OSError) -> None:
        """Drop a block whose files cannot be read (counted in its tier's `read_errors`,
        logged with the path) and read it again from the shared store, once: requests
        for it wait for that read and take their rows from it, and the block goes back
        into the fastest tier with room (else it is streamed from then on). A failed read
        (`BlockReadError`) fails the waiting requests and leaves the block streamed."""
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

    async def serve(self, requests: Dict[str, np.ndarray], priority: float = LAST,
                    wait: float = 0.0) -> Tuple[Arrays, int]:
        """(the rows of several held blocks, concatenated per field in request order; how
        many of them were read from the store for this request). A block whose load task
        this worker is running or about to run is waited for, up to `wait` seconds;
        `MissingBlocks` names those it does not hold then.

        One array per field (not one per block) keeps messages to a few frames."""
        missing = [key for key in requests if key not in self.store]
        if missing and wait > 0:
            await self._wait_for_loads(missing, wait)
            missing = [key for key in requests if key not in self.store]
        if missing:
            raise MissingBlocks(missing)
        taken = await asyncio.gather(*(self.take(key, rows, priority) for key, rows in requests.items()))
        parts = [arrays for arrays, _ in taken]
        return ({f: _concat([p[f] for p in parts]) for f in parts[0]} if parts else {}), sum(n for _, n in taken)

    async def rows_handler(self, msg, priority=None, wait=0.0):
        """RPC `dmdask_rows`: {key: rows} -> one array per field and "from_store" (how many
        of the rows were read from the store for this request), or the missing keys.
        `priority`: the position of the batch that waits for these rows (lower is served
        first; None: after every prioritised read). `wait`: seconds to wait for blocks
        this worker is loading (at most `MAX_WAIT`). Rows that are not offsets inside
        their block raise `ValueError` (`take`), which the caller's RPC re-raises."""
        check.mapping("dmdask_rows", "msg", msg)
        if priority is not None:
            check.number("dmdask_rows", "priority", priority, 0, float("inf"))
        check.number("dmdask_rows", "wait", wait, 0, MAX_WAIT)
        try:
            rows, from_store = await self.serve(msg, LAST if priority is None else float(priority),
                                                float(wait))
        except MissingBlocks as exc:
            return {"status": "missing", "keys": exc.keys}
        self.peer_bytes_out += _nbytes(rows)
        return {"status": "OK", "rows": to_serialize(rows), "from_store": from_store}

    def describe_handler(self, keys):
        """RPC `dmdask_describe`: {key: how to map the block's files, or None} for held
        blocks (keys not held are left out); a block held in files can be read by the
        worker's user (or group) on this host."""
        check.texts("dmdask_describe", "keys", keys)
        out = {}
        for key in keys:
            if key not in self.store:
                continue  # not held (yet): the caller asks again
            value = self.store[key]
            if isinstance(value, FileBlock) and not value.files_exist():
                value = None  # its files are gone: rows through `dmdask_rows`, which reads it again
            out[key] = value.describe() if isinstance(value, (FileBlock, ArenaBlock)) else None
        return out

    def count_hits_handler(self, hits):
        """RPC `dmdask_count_hits`: {tier: [samples, bytes]} that training processes on this
        host took from this worker's files themselves, counted like any other hit. Every
        count is checked before any is added."""
        check.mapping("dmdask_count_hits", "hits", hits, known=("ram", "ssd"))
        counted = []
        for tier, pair in hits.items():
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise check.refuse("dmdask_count_hits", f"hits[{tier!r}]", "[samples, bytes]", pair)
            counted.append((tier, check.count("dmdask_count_hits", f"hits[{tier!r}] samples", pair[0]),
                            check.count("dmdask_count_hits", f"hits[{tier!r}] bytes", pair[1])))
        for tier, samples, nbytes in counted:
            self.store.count_hit(tier, samples, nbytes)

    async def batch_handler(self, msg):
        """RPC `dmdask_batch`: gather consecutive batches from their holders, in batch order.

        msg: "requests" holder -> block key -> rows; "positions" holder -> where its rows
        go in the group; "index", "sizes" (batch lengths), "fields", "transform",
        "context" ({"epoch", "seed"}: what `dmdask.transform_context()` gives the transform),
        and optionally "extra": more fields of the group, given whole (a mixture's "source"),
        "priority": the position of the group's first batch (its reads go first), and
        "wait": seconds a holder may wait for blocks it is loading (`serve`), so that a
        group sent to a block's planned holder is not served in part and asked again."""
        check_batch_request(msg)
        requests: Dict[str, Dict[str, np.ndarray]] = msg["requests"]
        me = self.worker.address

        priority = msg.get("priority")
        wait = check.number("dmdask_batch", "wait", msg.get("wait", 0.0), 0, MAX_WAIT)

        async def from_holder(holder, wanted):
            if holder == me:
                return await self.serve(wanted, LAST if priority is None else float(priority), float(wait))
            try:
                reply = await self.worker.rpc(holder).dmdask_rows(msg=to_serialize(wanted), priority=priority,
                                                                  wait=wait)
            except RuntimeError as exc:  # this worker is closing ("ConnectionPool is closed"): a lost worker
                raise CommClosedError(f"worker {me} is closing: {exc}") from None
            if reply["status"] == "missing":
                raise MissingBlocks(reply["keys"])
            self.peer_bytes_in += _nbytes(reply["rows"])
            return reply["rows"], reply["from_store"]

        try:
            taken = await asyncio.gather(*(from_holder(h, w) for h, w in requests.items()))
        except MissingBlocks as exc:
            return {"status": "missing", "keys": exc.keys}
        replies, from_store = [rows for rows, _ in taken], sum(n for _, n in taken)
        index = msg["index"]
        group = {}
        for f in msg["fields"]:
            first = replies[0][f]
            out = np.empty((len(index),) + first.shape[1:], dtype=first.dtype)
            for holder, rows in zip(requests, replies):
                out[msg["positions"][holder]] = rows[f]
            group[f] = out
        group.update(msg.get("extra") or {})
        group["index"] = index
        bounds = np.cumsum([0] + list(msg["sizes"]))
        batches = [{f: v[a:b] for f, v in group.items()} for a, b in zip(bounds[:-1], bounds[1:])]
        if msg["transform"] is None:
            return {"status": "OK", "batches": to_serialize(batches), "from_store": from_store}
        context = TransformContext(**msg["context"]) if msg.get("context") else None
        if msg.get("isolate"):  # after a worker loss: in a process of its own, which may die
            done, error = await asyncio.get_running_loop().run_in_executor(
                self.transforms, transform_isolated, msg["transform"], batches, context)
        else:
            done, error = await asyncio.get_running_loop().run_in_executor(
                self.transforms, transform_in_order, loads_transform(msg["transform"]), batches, context)
        reply = {"status": "OK", "error": error, "from_store": from_store}
        folder = self.store.shared_folder() if msg.get("same_host") else None
        if folder is not None and done and shareable(done):  # the trainer maps them: no pickle, no socket
            reply["shared"] = await asyncio.get_running_loop().run_in_executor(
                self.transforms, write_batches, folder, done)
        else:
            reply["batches"] = to_serialize(done)
        return reply

    def close(self) -> None:
        self.reads.shutdown(wait=False, cancel_futures=True)
        self.transforms.shutdown(wait=False, cancel_futures=True)

    # -- accounting --------------------------------------------------------------------
    def stats(self) -> dict:
        tiers = self.store.stats()
        return {
            "ram": tiers["ram"],
            "ssd": tiers["ssd"],
            "streamed_blocks": tiers["streamed_blocks"],
            "stream": {"hits": self.streamed_hits, "buffer_bytes": self.stream.bytes,
                       "buffer_capacity": self.stream.capacity},
            "shared_store": {"requests": self.store_reads.requests, "bytes": self.store_reads.bytes,
                             "retries": self.store_reads.retries},
            "peer": {"bytes_out": self.peer_bytes_out, "bytes_in": self.peer_bytes_in},
        }


MAX_WAIT = 5.0  # seconds a request may wait for blocks this worker is loading
LOADING_STATES = frozenset({"waiting", "ready", "constrained", "executing", "long-running"})


class MissingBlocks(Exception):
    """The asked worker does not hold these blocks (yet, or any more)."""

    def __init__(self, keys):
        self.keys = list(keys)
        super().__init__(f"blocks not held here: {self.keys[:3]}...")


BATCH_KEYS = ("requests", "positions", "index", "sizes", "fields", "transform", "context", "extra", "isolate",
              "same_host", "priority", "wait")


def check_batch_request(msg) -> None:
    """`HandlerArgumentError` unless `msg` is a `dmdask_batch` request (the rows
    themselves are checked against their blocks when taken, `check_rows`)."""
    handler = "dmdask_batch"
    check.mapping(handler, "msg", msg, known=BATCH_KEYS, required=("requests", "positions", "index", "sizes",
                                                                     "fields", "transform"))
    index = np.asarray(msg["index"])
    if index.ndim != 1 or (index.size and index.dtype.kind not in "iu"):
        raise check.refuse(handler, "index", "a 1-d array of sample ids", msg["index"])
    sizes = msg["sizes"]
    if not isinstance(sizes, (list, tuple)) or sum(check.count(handler, "sizes", s) for s in sizes) != len(index):
        raise check.refuse(handler, "sizes", f"batch lengths that add up to {len(index)}", sizes)
    check.texts(handler, "fields", msg["fields"])
    requests = check.mapping(handler, "requests", msg["requests"])
    positions = check.mapping(handler, "positions", msg["positions"], known=list(requests), required=list(requests))
    for holder, wanted in requests.items():
        check.mapping(handler, f"requests[{holder!r}]", wanted)
        check.indices(handler, f"positions[{holder!r}]", positions[holder], len(index))
    if msg["transform"] is not None and not isinstance(msg["transform"], bytes):
        raise check.refuse(handler, "transform", "a pickled transform (bytes) or None", type(msg["transform"]))
    if msg.get("context") is not None:
        context = check.mapping(handler, "context", msg["context"], known=("epoch", "seed"),
                                required=("epoch", "seed"))
        for name in ("epoch", "seed"):
            check.count(handler, f"context[{name!r}]", context[name])
    if msg.get("extra") is not None:
        check.mapping(handler, "extra", msg["extra"])
    for name in ("isolate", "same_host"):
        if name in msg:
            check.flag(handler, name, msg[name])
    if msg.get("priority") is not None:
        check.count(handler, "priority", msg["priority"])


def check_rows(key: str, rows, length: int) -> np.ndarray:
    """`rows` as an int64 array when it holds offsets in 0..length-1 (numpy would take a
    negative offset from the block's end); otherwise ValueError naming the block `key`
    and the bad offsets."""
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


def _length(value) -> int:
    """Samples of a held block (a `Streamed` marker's from its reader)."""
    return value.reader.stop - value.reader.start if isinstance(value, Streamed) else len(value)


def _concat(arrays):
    if len(arrays) == 1:
        return arrays[0]
    if arrays and arrays[0].dtype == object:
        out = np.empty(sum(len(a) for a in arrays), dtype=object)
        i = 0
        for a in arrays:
            out[i:i + len(a)] = a
            i += len(a)
        return out
    return np.concatenate(arrays)


def _nbytes(arrays: Arrays) -> int:
    total = 0
    for a in arrays.values():
        total += a.nbytes if a.dtype != object else sum(v.nbytes for v in a)
    return total


