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
  host through a file in shared memory (`dmdask.worker.results`), to others over TCP.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict

import distributed
import numpy as np
from distributed.comm.core import CommClosedError
from distributed.protocol.serialize import to_serialize

from ..spec import TransformContext, loads_transform
from .arena import ArenaBlock
from .handover import Handovers
from .holdings import Arrays, Block, FileBlock, FillingBlock, Streamed, sample_nbytes
from .results import shareable, write_batches
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
        self.reads = ThreadPoolExecutor(read_threads, thread_name_prefix="dmdask-read")
        self.transforms = ThreadPoolExecutor(transform_threads, thread_name_prefix="dmdask-transform")
        self.store_reads = StoreCounters()
        self.stream = StreamBuffer(stream_buffer, self.read, self.reads)
        self.streamed_hits = 0  # samples served from blocks streamed from the store
        self.peer_bytes_out = 0
        self.peer_bytes_in = 0
        self.handovers = Handovers()
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
        content = self.handovers.take(reader.key)
        arrays = reader.decode(content) if content is not None else reader.read(on_retry=self.store_reads.retried)
        block = Block(arrays, reader.start, reader.stop)
        self.store_reads.add(block.nbytes)
        return block

    def hand_over_handler(self, blocks: Dict[str, bytes]) -> list:
        """Keep blocks' bytes for their load tasks; the keys kept (others had no room)."""
        return [key for key, content in blocks.items() if self.handovers.put(key, content)]

    def read_rows(self, reader, rows) -> Arrays:
        arrays = reader.read_rows(rows, on_retry=self.store_reads.retried)
        self.store_reads.add(_nbytes(arrays))
        return arrays

    def load(self, reader):
        """Body of the `load_block` task: read once, keep in the fastest tier with room.

        Room is reserved before the read when the block's size is known; a block whose
        size only the read tells (an HTTP folder lists no sizes) is charged once read."""
        if reader.nbytes is None:
            return self._load_unsized(reader)
        tier = self.store.reserve(reader.nbytes)
        if tier is None:
            self.handovers.take(reader.key)  # no room: its reader has the bytes; later reads stream them
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
    async def take(self, key: str, rows: np.ndarray) -> Arrays:
        """Rows of a block this worker holds; KeyError if it holds no such block,
        ValueError naming the block and the bad offsets (before anything is read) unless
        `rows` are offsets inside the block."""
        value = self.store[key]
        if isinstance(value, (Block, FillingBlock, FileBlock, ArenaBlock, Streamed)):
            rows = check_rows(key, rows, _length(value))
        if key in self._rereads:  # its files failed and it is being read again: wait for that read
            block, _ = await asyncio.shield(self._rereads[key])
            self.streamed_hits += len(rows)
            return block.take(rows)
        if isinstance(value, Block):
            out = value.take(rows)
            tier = "ram"
        elif isinstance(value, FillingBlock):
            async with value.filling:  # a retried request must not read rows still being read
                missing = value.missing(rows)
                arrays = None
                if len(missing):
                    arrays = await asyncio.get_running_loop().run_in_executor(
                        self.reads, self.read_rows, value.reader, missing)
                    self.streamed_hits += len(missing)
                    kept = len(missing)
                    if not value.sized:
                        sizes = sample_nbytes(arrays)
                        kept = self.store.charge("ram", sizes)
                        value.samples += kept
                        value.nbytes += int(sizes[:kept].sum())
                    value.fill(missing[:kept], {f: a[:kept] for f, a in arrays.items()})
            out = value.take(rows, missing, arrays)
            hits = len(rows) - len(missing)
            if hits:
                self.store.count_hit("ram", hits, _nbytes(out) * hits // len(rows))
            return out
        elif isinstance(value, (FileBlock, ArenaBlock)):
            try:
                out = await asyncio.get_running_loop().run_in_executor(self.reads, value.take, rows)
            except OSError as exc:  # its files were deleted or cannot be read
                if not isinstance(value, FileBlock) or value.reader is None:
                    raise
                if self.store.get(key) is value:  # the first request to find out
                    self._reread(key, value, exc)
                return await self.take(key, rows)  # from the block read again
            tier = value.tier
        elif isinstance(value, Streamed) and value.reader.row_granular:
            # one file per sample: read just these samples, nothing is held afterwards
            out = await asyncio.get_running_loop().run_in_executor(self.reads, self.read_rows, value.reader, rows)
            self.streamed_hits += len(rows)
            return out
        elif isinstance(value, Streamed):
            block = await self.stream.get(value.reader)
            self.streamed_hits += len(rows)
            out = block.take(rows)
            self.stream.served(key, len(rows))
            return out
        else:
            raise KeyError(key)
        self.store.count_hit(tier, len(rows), _nbytes(out))
        return out

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
        loop = asyncio.get_running_loop()
        pending = self._rereads[key] = loop.run_in_executor(self.reads, self._read_and_place, reader)

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

    async def serve(self, requests: Dict[str, np.ndarray]) -> Arrays:
        """The rows of several held blocks, concatenated per field in request order.

        One array per field (not one per block) keeps messages to a few frames."""
        missing = [key for key in requests if key not in self.store]
        if missing:
            raise MissingBlocks(missing)
        parts = await asyncio.gather(*(self.take(key, rows) for key, rows in requests.items()))
        return {f: _concat([p[f] for p in parts]) for f in parts[0]} if parts else {}

    async def rows_handler(self, msg):
        """RPC `dmdask_rows`: {key: rows} -> one array per field, or the missing keys.
        Rows that are not offsets inside their block raise `ValueError` (`take`), which
        the caller's RPC re-raises."""
        try:
            rows = await self.serve(msg)
        except MissingBlocks as exc:
            return {"status": "missing", "keys": exc.keys}
        self.peer_bytes_out += _nbytes(rows)
        return {"status": "OK", "rows": to_serialize(rows)}

    def describe_handler(self, keys):
        """RPC `dmdask_describe`: {key: how to map the block's files, or None} for held
        blocks; a block held in files can be read by any process on this host."""
        out = {}
        for key in keys:
            value = self.store[key] if key in self.store else None
            if isinstance(value, FileBlock) and not value.files_exist():
                value = None  # its files are gone: rows through `dmdask_rows`, which reads it again
            out[key] = value.describe() if isinstance(value, (FileBlock, ArenaBlock)) else None
        return out

    def count_hits_handler(self, hits):
        """RPC `dmdask_count_hits`: {tier: [samples, bytes]} that training processes on this
        host took from this worker's files themselves, counted like any other hit."""
        for tier, (samples, nbytes) in hits.items():
            self.store.count_hit(tier, int(samples), int(nbytes))

    async def batch_handler(self, msg):
        """RPC `dmdask_batch`: gather consecutive batches from their holders, in batch order.

        msg: "requests" holder -> block key -> rows; "positions" holder -> where its rows
        go in the group; "index", "sizes" (batch lengths), "fields", "transform",
        "context" ({"epoch", "seed"}: what `dmdask.transform_context()` gives the transform),
        and optionally "extra": more fields of the group, given whole (a mixture's "source")."""
        requests: Dict[str, Dict[str, np.ndarray]] = msg["requests"]
        me = self.worker.address

        async def from_holder(holder, wanted):
            if holder == me:
                return await self.serve(wanted)
            try:
                reply = await self.worker.rpc(holder).dmdask_rows(msg=to_serialize(wanted))
            except RuntimeError as exc:  # this worker is closing ("ConnectionPool is closed"): a lost worker
                raise CommClosedError(f"worker {me} is closing: {exc}") from None
            if reply["status"] == "missing":
                raise MissingBlocks(reply["keys"])
            self.peer_bytes_in += _nbytes(reply["rows"])
            return reply["rows"]

        try:
            replies = await asyncio.gather(*(from_holder(h, w) for h, w in requests.items()))
        except MissingBlocks as exc:
            return {"status": "missing", "keys": exc.keys}
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
            return {"status": "OK", "batches": to_serialize(batches)}
        context = TransformContext(**msg["context"]) if msg.get("context") else None
        if msg.get("isolate"):  # after a worker loss: in a process of its own, which may die
            done, error = await asyncio.get_running_loop().run_in_executor(
                self.transforms, transform_isolated, msg["transform"], batches, context)
        else:
            done, error = await asyncio.get_running_loop().run_in_executor(
                self.transforms, transform_in_order, loads_transform(msg["transform"]), batches, context)
        reply = {"status": "OK", "error": error}
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


class MissingBlocks(Exception):
    """The asked worker does not hold these blocks (yet, or any more)."""

    def __init__(self, keys):
        self.keys = list(keys)
        super().__init__(f"blocks not held here: {self.keys[:3]}...")


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


