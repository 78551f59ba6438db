"""The dmdask worker: Dask's worker with tiered block storage and two RPC handlers.

- `load_block` (a Dask task, one per block, stable key): reads the block from the
  shared store once and admits it into the fastest tier with room, or leaves a
  `Streamed` marker when no tier has room. Its future is the block's cache entry.
- `dmdask_rows` (RPC): serves rows of the blocks this worker holds, to itself or to a
  peer. Rows of a streamed block come straight from the store when it holds one file
  per sample; otherwise the block goes through a small `StreamBuffer`, read once while
  the ranks take their rows of it.
- `dmdask_batch` (RPC, called by a rank on its own node): gathers one batch's rows from
  the holders (itself without a copy, peers over Dask's comms), puts them in batch
  order, runs the spec's transform and returns the batch.

Start it with `dask worker SCHEDULER --worker-class dmdask.Worker`; capacities come
from the `dmdask.worker` config namespace (or keyword arguments).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from typing import Dict, Optional

import dask
import distributed
import numpy as np
from dask.utils import parse_bytes
from distributed.protocol.serialize import to_serialize

from .block import Arrays, Block, FillingBlock, Streamed
from .errors import NotADmdaskWorker, SpecError, TransformError
from .spec import loads_transform
from .tiers import SsdBlock, TieredStore

logger = logging.getLogger(__name__)


def capacity(value, name: str) -> int:
    """Bytes from an int or a string such as "4 GiB"; a clear error otherwise."""
    try:
        result = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        result = -1
    if result < 0:
        raise SpecError(name, 'a size in bytes or a string such as "4 GiB"', value)
    return result


class StoreCounters:
    """Reads from the shared store made by this worker (blocks and decoded bytes)."""

    def __init__(self):
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes


class StreamBuffer:
    """Blocks beyond the cache, kept briefly while the ranks take their rows of them.

    A block leaves as soon as as many rows were served as it holds (every sample is
    asked for once per epoch), or earlier when the buffer is full (least recently used
    first), so it never acts as a cache across epochs. One read per block at a time:
    concurrent askers wait for the same read. Used only from the worker's event loop.
    """

    def __init__(self, capacity_bytes: int, read):
        self.capacity = capacity_bytes
        self.bytes = 0
        self._read = read
        self._blocks: "OrderedDict[str, Block]" = OrderedDict()
        self._served: Dict[str, int] = {}
        self._loading: Dict[str, asyncio.Future] = {}

    async def get(self, reader) -> Block:
        key = reader.key
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return self._blocks[key]
        if key in self._loading:
            return await asyncio.shield(self._loading[key])
        loop = asyncio.get_running_loop()
        fut = self._loading[key] = loop.create_future()
        try:
            block = await loop.run_in_executor(None, self._read, reader)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: the awaiting callers re-raise it
            raise
        finally:
            del self._loading[key]
        self.put(key, block)
        fut.set_result(block)
        return block

    def put(self, key: str, block: Block) -> None:
        if block.nbytes > self.capacity or key in self._blocks:
            return
        while self.bytes + block.nbytes > self.capacity and self._blocks:
            self._drop(next(iter(self._blocks)))
        self._blocks[key] = block
        self._served[key] = 0
        self.bytes += block.nbytes

    def served(self, key: str, rows: int) -> None:
        """Count rows handed out; drop the block once all of its rows were."""
        if key not in self._blocks:
            return
        self._served[key] += rows
        if self._served[key] >= len(self._blocks[key]):
            self._drop(key)

    def _drop(self, key: str) -> None:
        block = self._blocks.pop(key)
        self._served.pop(key, None)
        self.bytes -= block.nbytes


class BlockCache:
    """dmdask's state on one worker: tiers, stream buffer, counters and handlers."""

    def __init__(self, worker: distributed.Worker, store: TieredStore, stream_buffer: int):
        self.worker = worker
        self.store = store
        self.store_reads = StoreCounters()
        self.stream = StreamBuffer(stream_buffer, self.read)
        self.streamed_hits = 0  # samples served from blocks streamed from the store
        self.peer_bytes_out = 0
        self.peer_bytes_in = 0
        worker.handlers["dmdask_rows"] = self.rows_handler
        worker.handlers["dmdask_batch"] = self.batch_handler
        worker.metrics["dmdask"] = lambda worker: self.stats()

    # -- reading from the shared store -------------------------------------------------
    def read(self, reader) -> Block:
        block = reader.read()
        self.store_reads.add(block.nbytes)
        return block

    def read_rows(self, reader, rows) -> Arrays:
        arrays = reader.read_rows(rows)
        self.store_reads.add(_nbytes(arrays))
        return arrays

    def load(self, reader):
        """Body of the `load_block` task: read once, keep in the fastest tier with room."""
        tier = self.store.reserve(reader.nbytes)
        if tier is None:
            return Streamed(reader)
        if tier == "ram" and reader.row_granular:  # filled sample by sample as ranks ask
            return self.store.place(reader.key, tier, FillingBlock(reader), reader.nbytes)
        try:
            block = self.read(reader)
        except BaseException:
            self.store.unreserve(tier, reader.nbytes)
            raise
        value = self.store.place(reader.key, tier, block, reader.nbytes)
        if value is None:  # the SSD refused the write: keep what was read for this epoch
            if not reader.row_granular:
                self.worker.loop.add_callback(self.stream.put, reader.key, block)
            return Streamed(reader)
        return value

    # -- serving rows ------------------------------------------------------------------
    async def take(self, key: str, rows: np.ndarray) -> Arrays:
        """Rows of a block this worker holds; KeyError if it holds no such block."""
        value = self.store[key]
        if isinstance(value, Block):
            out = value.take(rows)
            tier = "ram"
        elif isinstance(value, FillingBlock):
            missing = value.missing(rows)
            if len(missing):
                arrays = await asyncio.get_running_loop().run_in_executor(
                    None, self.read_rows, value.reader, missing)
                value.fill(missing, arrays)
                self.streamed_hits += len(missing)
            out = value.take(rows)
            hits = len(rows) - len(missing)
            if hits:
                self.store.count_hit("ram", hits, _nbytes(out) * hits // len(rows))
            return out
        elif isinstance(value, SsdBlock):
            out = await asyncio.get_running_loop().run_in_executor(None, value.take, rows)
            tier = "ssd"
        elif isinstance(value, Streamed) and value.reader.row_granular:
            # one file per sample: read just these samples, nothing is held afterwards
            out = await asyncio.get_running_loop().run_in_executor(None, self.read_rows, value.reader, rows)
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

    async def serve(self, requests: Dict[str, np.ndarray]) -> Arrays:
        """The rows of several held blocks, concatenated per field in request order.

        One array per field (not one per block) keeps messages to a few frames."""
        missing = [key for key in requests if key not in self.store]
        if missing:
            raise MissingBlocks(missing)
        parts = await asyncio.gather(*(self.take(key, rows) for key, rows in requests.items()))
        return {f: _concat([p[f] for p in parts]) for f in parts[0]} if parts else {}

    async def rows_handler(self, msg):
        """RPC `dmdask_rows`: {key: rows} -> one array per field, or the missing keys."""
        try:
            rows = await self.serve(msg)
        except MissingBlocks as exc:
            return {"status": "missing", "keys": exc.keys}
        self.peer_bytes_out += _nbytes(rows)
        return {"status": "OK", "rows": to_serialize(rows)}

    async def batch_handler(self, msg):
        """RPC `dmdask_batch`: gather consecutive batches from their holders, in batch order.

        msg: "requests" holder -> block key -> rows; "positions" holder -> where its rows
        go in the group; "index", "sizes" (batch lengths), "fields", "transform"."""
        requests: Dict[str, Dict[str, np.ndarray]] = msg["requests"]
        me = self.worker.address

        async def from_holder(holder, wanted):
            if holder == me:
                return await self.serve(wanted)
            reply = await self.worker.rpc(holder).dmdask_rows(msg=to_serialize(wanted))
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
        group["index"] = index
        bounds = np.cumsum([0] + list(msg["sizes"]))
        batches = [{f: v[a:b] for f, v in group.items()} for a, b in zip(bounds[:-1], bounds[1:])]
        transform = loads_transform(msg["transform"])
        if transform is not None:
            batches = await asyncio.get_running_loop().run_in_executor(
                None, lambda: [_apply(transform, b) for b in batches])
        return {"status": "OK", "batches": to_serialize(batches)}

    # -- accounting --------------------------------------------------------------------
    def stats(self) -> dict:
        tiers = self.store.stats()
        return {
            "ram": tiers["ram"],
            "ssd": tiers["ssd"],
            "streamed_blocks": tiers["streamed_blocks"],
            "stream": {"hits": self.streamed_hits, "buffer_bytes": self.stream.bytes,
                       "buffer_capacity": self.stream.capacity},
            "shared_store": {"requests": self.store_reads.requests, "bytes": self.store_reads.bytes},
            "peer": {"bytes_out": self.peer_bytes_out, "bytes_in": self.peer_bytes_in},
        }


class MissingBlocks(Exception):
    """The asked worker does not hold these blocks (yet, or any more)."""

    def __init__(self, keys):
        self.keys = list(keys)
        super().__init__(f"blocks not held here: {self.keys[:3]}...")


def _apply(transform, batch: dict) -> dict:
    try:
        out = transform(batch)
    except Exception as exc:  # never mistaken for a lost worker (an OSError) by the client
        raise TransformError(f"Spec.transform failed on the batch of samples {batch['index'][:4].tolist()}...: "
                             f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(out, dict):
        raise TypeError(f"Spec.transform must return a dict of arrays, got {type(out).__name__}")
    out.setdefault("index", batch["index"])
    return out


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


def load_block(reader):
    """Dask task: the value of a block's key on the worker that runs it."""
    worker = distributed.get_worker()
    cache: Optional[BlockCache] = getattr(worker, "dmdask", None)
    if cache is None:
        raise NotADmdaskWorker(
            f"worker {worker.address} has no dmdask tiers; start workers with "
            "`dask worker ADDR --worker-class dmdask.Worker` or use dmdask.LocalCluster"
        )
    return cache.load(reader)


class Worker(distributed.Worker):
    """A Dask worker whose storage holds dmdask blocks in a RAM and an SSD tier.

    ram, ssd: per-worker capacities (bytes or "4 GiB"); ssd=0 disables the SSD tier.
    ssd_dir: folder of the SSD tier (default: the worker's local directory).
    stream_buffer: bytes for blocks beyond the cache while ranks take their rows.
    Unset values come from the `dmdask.worker` dask config namespace.
    """

    def __init__(self, *args, ram=None, ssd=None, ssd_dir=None, stream_buffer=None, **kwargs):
        def config(name, value):
            return value if value is not None else dask.config.get(f"dmdask.worker.{name}")

        store = TieredStore(
            ram=capacity(config("ram", ram), "ram"),
            ssd=capacity(config("ssd", ssd), "ssd"),
            ssd_dir=config("ssd-dir", ssd_dir),
        )
        kwargs["data"] = store
        super().__init__(*args, **kwargs)
        if store._ssd_root is None:
            store._ssd_root = self.local_directory
        buffer = capacity(config("stream-buffer", stream_buffer), "stream_buffer")
        self.dmdask = BlockCache(self, store, buffer)

    async def close(self, *args, **kwargs):
        try:
            return await super().close(*args, **kwargs)
        finally:
            self.dmdask.store.close()


class Nanny(distributed.Nanny):
    """A Dask nanny that starts a dmdask `Worker` (keyword arguments pass through)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("worker_class", Worker)
        super().__init__(*args, **kwargs)
