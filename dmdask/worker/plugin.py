"""dmdask's worker side as a Dask worker plugin, which the scheduler plugin installs on
every worker (as `distributed.shuffle` does), with the handlers of `dmdask.protocol.worker`."""
from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import time

import dask
import distributed
import numpy as np
from distributed.comm import get_address_host
from distributed.comm.core import CommClosedError
from distributed.core import Status
from distributed.protocol.pickle import loads

from ..errors import HandlerArgumentError, plain_worker
from ..fs.inside import serve_worker
from ..protocol.rows import RowChannels, asked_of
from ..recovery import reply_seconds
from ..protocol.worker import (Batches, BatchRequest, Channel, ChannelRequest, DescribeRequest, Descriptions, GiveRows,
                               PlaceBlocks, Placed,
                               HandOver, HitsReport, Kept, Missing, Moved, OPS, WorkerAPI, handler)
from ..internals import run_next
from ..scheduler.placement import RUN_NEXT, STREAMED_TOPIC
from ..source.urls import check_source
from ..shm.fileblocks import assemble
from ..shm.results import shareable, write_batches
from ..spec import loads_transform
from ..threads import ForkSafeExecutor
from .cache import BlockCache
from .filling import FillingBlock
from .holdings import GroupHeld, Holding, payload_bytes
from . import sizing
from .peers import ClusterWorkers
from .reads import LAST
from .row_server import RowServer
from .tiers import TieredStore
from .transforms import transform_in_order, transform_isolated


logger = logging.getLogger(__name__)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a file system (or quota) with no room left


def _refusing(op: str, address: str):
    """The handler of dmdask's `op` on a plain Dask worker: `NotADmdaskWorker`."""
    def refuse(**_):
        raise plain_worker(address)
    refuse.__name__ = op
    return refuse


class WorkerPlugin(distributed.WorkerPlugin):
    """dmdask on one worker: its `BlockCache` (`worker.extensions["dmdask"]`) and handlers.
    On a worker without dmdask's tiers (a plain Dask worker) every dmdask handler raises
    `NotADmdaskWorker` naming the worker and the fix (and `load_block` tasks do). Handlers use
    `cache`, `address`, `peers` (a `WorkerAPI`), `channels` (`RowChannels`) and `workers`
    (`ClusterWorkers`; None: any holder is dialled) only: testable without a cluster."""

    name = "dmdask"
    idempotent = True

    def __init__(self):
        self.cache = None
        self.address = None
        self.peers = None
        self.channels = None
        self.server = None
        self.workers = None
        self.worker = None
        self.warned_full = False

    def setup(self, worker) -> None:
        serve_worker(worker)  # dmdask:: reads in its tasks use its own connection
        if not isinstance(worker.data, TieredStore):
            for op in OPS.values():  # (a handler the worker already has for one is kept)
                worker.handlers.setdefault(op, _refusing(op, worker.address))
            return
        self.cache = worker.extensions.get("dmdask")  # kept when added again (by a new scheduler)
        if self.cache is None:
            self.cache = BlockCache(worker, worker.data, worker.stream_buffer,
                                    read_threads=int(dask.config.get("dmdask.worker.read-threads")),
                                    read_ahead=bool(dask.config.get("dmdask.worker.read-ahead")),
                                    transform_threads=int(dask.config.get("dmdask.worker.transform-threads")))
        self.worker, self.address, self.peers = worker, worker.address, WorkerAPI(worker.rpc)
        tls = worker.address.startswith("tls://")
        self.server = worker.extensions.get("dmdask-rows")
        if self.server is None:
            context = worker.security.get_listen_args("worker").get("ssl_context") if tls else None
            self.server = worker.extensions["dmdask-rows"] = RowServer(
                self.cache, get_address_host(worker.address), context, dask.config.get("dmdask.worker.row-port"))
        context = worker.security.get_connection_args("worker").get("ssl_context")
        self.channels = RowChannels(self.peers, context, reply_seconds())
        self.workers = ClusterWorkers(worker)
        worker.handlers.update({OPS[kind]: handler(kind, self._lost_once_closed(method)) for kind, method in (
            (BatchRequest, self.batch), (DescribeRequest, self.describe),
            (HitsReport, self.count_hits), (HandOver, self.hand_over), (PlaceBlocks, self.place_blocks),
            (GiveRows, self.give_rows),
            (ChannelRequest, self.channel))})
        worker.extensions["dmdask"] = self.cache
        worker.stream_handlers[RUN_NEXT] = self.run_next
        oom_file = sizing.oom_kill_file()  # its cgroup's: counts kills of the worker's earlier processes too
        worker.metrics["dmdask"] = lambda worker: {**self.cache.stats(), "oom_kills": sizing.oom_kills(oom_file)}

    def _lost_once_closed(self, method):
        """`method`, whose RuntimeError while this worker closes (its read and transform
        threads shut down: "cannot schedule new futures after shutdown"; its connection pool
        closed: "ConnectionPool is closed") reaches the caller as a lost worker's
        CommClosedError, which a rank recovers from as from any lost worker."""
        async def call(request):
            try:
                reply = method(request)
                return (await reply) if inspect.isawaitable(reply) else reply
            except RuntimeError as exc:
                if self.worker.status not in (Status.closing, Status.closed):
                    raise
                raise CommClosedError(f"worker {self.address} is closing: {exc}") from None
        return call

    def transition(self, key, start, finish, **kwargs) -> None:
        """Tell the scheduler of each block this worker holds as a `Streamed` marker (a
        joining worker loads it again: `dmdask.scheduler.placement.win_back`); read the
        rows of each `FillingBlock` ahead of the ranks (`ReadAhead`)."""
        if finish == "memory" and self.cache is not None:
            held = self.cache.store.get(key)
            members = held.keys if isinstance(held, GroupHeld) else [key]  # a load group: each of its blocks
            for block in members:
                value = self.cache.store.get(block)
                if isinstance(value, FillingBlock):
                    self.cache.ahead.add(block, value)
                elif isinstance(value, Holding) and value.tier is None:
                    self.worker.log_event(STREAMED_TOPIC, block)

    def run_next(self, keys=(), rank: float = 0.0, **kwargs) -> None:
        """The scheduler's word (`RUN_NEXT`, on its stream) that ranks wait for these load
        groups: those still queued here run next (`dmdask.internals.run_next`)."""
        run_next(self.worker.state, list(keys), float(rank))

    def teardown(self, worker) -> None:
        if self.cache is not None and worker.status == Status.closing:  # not when added again
            self.server.close()
            self.cache.close()

    async def batch(self, request: BatchRequest):
        """`Batches` of the group, or `Missing` for blocks a holder does not hold, and,
        before anything is dialled, for the blocks of holders that are not workers of the
        cluster (its scheduler's): a holder that died (the rank locates those blocks again),
        or an address that never was one (a worker connects only to its cluster's workers)."""
        strangers = [] if self.workers is None else await self.workers.strangers(
            h for h in request.requests if h != self.address)
        if strangers:  # never dialled: gone (a rank's stale holder, located again) or never a worker
            return Missing([key for h in strangers for key in request.requests[h]])

        async def from_holder(holder, wanted):
            if holder == self.address:
                return await self.cache.serve(wanted, _priority(request.priority), request.wait)
            arrays, from_store = await self.channels.fetch(_peer_threads, holder,
                                                           asked_of(wanted, request.priority, request.wait))
            self.cache.peer_bytes_in += payload_bytes(arrays)
            return arrays, from_store

        try:
            taken = await asyncio.gather(*(from_holder(h, w) for h, w in request.requests.items()))
        except Moved as exc:
            return Missing(exc.keys)
        from_store = sum(n for _, n in taken)
        rows = assemble(((request.positions[h], arrays) for h, (arrays, _) in zip(request.requests, taken)),
                        len(request.index))
        group = {f: rows[f] for f in request.fields}
        group.update(request.extra or {})
        group["index"] = request.index
        bounds = np.cumsum([0] + list(request.sizes))
        batches = [{f: v[a:b] for f, v in group.items()} for a, b in zip(bounds[:-1], bounds[1:])]
        if request.transform is None:
            return Batches(batches=batches, from_store=from_store)
        loop = asyncio.get_running_loop()
        if request.isolate:  # after a worker loss: in a process of its own, which may die
            work = (transform_isolated, request.transform)
        else:
            work = (transform_in_order, loads_transform(request.transform))
        done, error = await loop.run_in_executor(self.cache.transforms, *work, batches, request.context)
        folder = self.cache.store.shared_folder() if request.same_host else None
        if folder is not None and done and shareable(done):  # the trainer maps them: no pickle, no socket
            try:
                shared = await loop.run_in_executor(self.cache.transforms, write_batches, folder, done)
                return Batches(shared=shared, error=error, from_store=from_store)
            except OSError as exc:  # a full shared-memory folder: the batches go through the connection
                if exc.errno not in FULL_ERRNOS:
                    raise
                self._warn_full(folder, exc)
        return Batches(batches=done, error=error, from_store=from_store)

    def channel(self, request: ChannelRequest) -> Channel:
        """Where this worker serves rows (`dmdask.protocol.rows`)."""
        return self.server.channel
    def _warn_full(self, folder: str, exc: OSError) -> None:
        """Say once per worker that its shared-memory folder is full (batches then come by value)."""
        if not self.warned_full:
            self.warned_full = True
            logger.warning("the shared-memory folder %s is full (%s): transformed batches go to the training "
                           "processes through their connection instead, until there is room", folder, exc)

    def describe(self, request: DescribeRequest) -> Descriptions:
        """How to map each held block's files (None: rows through its row channel); blocks
        not held (yet) are left out, the caller asks again. A block held in files can be
        read by the worker's user (or group) on this host."""
        store = self.cache.store
        held = {key: store[key] for key in request.keys if key in store}
        return Descriptions({key: value.describe() if isinstance(value, Holding) else None
                             for key, value in held.items()})

    def count_hits(self, request: HitsReport) -> None:
        """Count rows that training processes on this host took from this worker's files
        themselves like any other hit (every count was checked before any is added)."""
        for tier, (samples, nbytes) in request.hits.items():
            self.cache.store.count_hit(tier, int(samples), int(nbytes))

    async def place_blocks(self, request: PlaceBlocks) -> Placed:
        """Keep blocks a transparent-mode reader read from the store as this worker's own,
        without a load task each (`dmdask.fs.claims`): each placed in a tier as its load task
        would place it (`BlockCache.load`, which takes the bytes handed over with the reader's
        claim), then put in the worker's data as Dask's scatter puts data; the reader then tells
        the scheduler (`FsHeld`). A block this worker has already, or fails to place, is left
        out of the reply: its reader submits its load task instead."""
        readers = loads(request.readers)
        if not isinstance(readers, list) or any(getattr(r, "key", None) not in request.blocks for r in readers):
            raise HandlerArgumentError(f"dmdask_place_blocks: readers must be the StoreReaders of the blocks handed "
                                       f"over, got {type(readers).__name__}")
        data, tasks, store = self.worker.data, self.worker.state.tasks, self.cache.store

        def place() -> dict:
            placed = {}
            for reader in readers:
                if reader.key in data or reader.key in tasks:  # held, or its load task is here
                    continue
                try:
                    for url in reader.sources():
                        check_source(url)
                    reader.claim = request.claim
                    content = request.blocks[reader.key]
                    self.cache.handovers.put(reader.key, request.claim, content, len(content))
                    placed[reader.key] = self.cache.load(reader)
                except Exception as exc:  # noqa: BLE001 - left to its load task, which names the error
                    self.cache.handovers.take(reader.key, request.claim)
                    logger.debug("could not place handed-over block %s: %r", reader.key, exc)
            return placed

        placed = await asyncio.get_running_loop().run_in_executor(_place_threads, place)
        for key in [key for key in placed if key in data or key in tasks]:  # came meanwhile: this copy freed
            value = placed.pop(key)
            if key not in store:
                store[key] = value  # its tier's reservation turns into held bytes, then is freed
                del store[key]
        if not placed:
            return Placed({})
        nbytes = self.worker.update_data(placed, stimulus_id=f"dmdask-place-{time.time()}")["nbytes"]
        return Placed({key: int(nbytes[key]) for key in placed})

    async def give_rows(self, request: GiveRows) -> Kept | Missing:
        """Keep the rows a rank read from the store itself (`BlockCache.receive`); `Missing`
        names the blocks not held once waited for."""
        taken, missing = await self.cache.receive(request.rows, request.arrays, request.claim, request.retries,
                                                  request.wait)
        return Missing(missing) if missing else Kept(taken)

    def hand_over(self, request: HandOver) -> Kept:
        """Keep blocks' bytes for their load tasks of `request.claim` (`Handovers`)."""
        return Kept([key for key, content in request.blocks.items()
                     if self.cache.handovers.put(key, request.claim, content, len(content))])


_peer_threads = ForkSafeExecutor(8, "dmdask-peer")
_place_threads = ForkSafeExecutor(1, "dmdask-place")  # blocks handed over to be placed (`place_blocks`)  # the rows of other workers, for this worker's transforms


def _priority(priority) -> float:
    return LAST if priority is None else float(priority)
