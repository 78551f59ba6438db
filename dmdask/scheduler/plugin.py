"""`DatasetsPlugin`: dmdask's scheduler side, the one owner of every dataset's blocks: a
registry (name -> description, blocks, planned worker of each), get-or-create claims, and
the blocks kept alive (a pseudo-client wants them, as Dask's published datasets do) until
`release`. Where blocks are, and who reads lazy ones: `dmdask.scheduler.reads`.

Guarantees:
- get-or-create is race-free (the scheduler's event loop): one caller at a time holds
  the claim to create a dataset, the others wait (a vanished holder's claim is handed
  on after `CLAIM_SECONDS`).
- a block's load runs on its planned worker (strict restrictions, set before the task
  is first scheduled); a leaving worker's unfinished and lost blocks are planned again
  over the workers present, or the next to join (`dmdask.scheduler.placement`).
- a dataset's claimant submits its blocks' loads in chunks (`dmdask.client.submit`): the
  dataset is ready once the first chunk is in, so ranks open it without waiting for every
  load to be registered; a rank that asks for a block not submitted yet waits for it, and
  the claimant submits the blocks ranks asked for next (`Submitted`, `Wanted`). No chunk
  costs the event loop more than its own blocks, and no more than `Submitted.ahead` loads
  wait unfinished besides those ranks asked for (10^6 pinned loads sent at once held each
  worker's event loop up to 21 s, measured). If the claimant's client leaves before it
  submitted every block, the next open creates the missing ones.
- a dataset of `GROUP_FROM_BLOCKS` blocks or more is loaded in load groups
  (`dmdask.plan.groups`): one task per `size` consecutive blocks of its load order,
  planned on one worker; `Locate`, the load counts, worker-loss re-planning, retries and
  `release` map a block to its group's task (a group waited for by a rank runs next on its
  worker: `RUN_NEXT`). Streamed blocks of such a dataset are not won back by a new worker.
- lazy datasets (`get_or_register`, `register` with `lazy`; transparent mode's files):
  ready once registered; a block's load is submitted by whoever first wants it. Their
  blocks are planned round-robin from where the previous lazy dataset stopped.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict

from distributed.diagnostics.plugin import SchedulerPlugin

from ..errors import redact
from ..internals import load_first
from ..plan.groups import GROUP_KEY_PREFIX, Groups, group_key, group_size, parse_group_key
from ..protocol.scheduler import (Abandon, Busy, Claimed, Datasets, DatasetSummary, FsClaim, FsHeld, FsMetadata,
                                  FsOpenBlocks,
                                  GetOrClaim, GetOrRegister, Held, LeftOnPurpose, Locate, NoWorkers, OpenBlocks, Ready, Register,
                                  Registered, Release, Submitted, Wanted, Workers, serve)
from ..source.base import BLOCK_KEY_PREFIX, DatasetInfo, block_key, parse_block_key
from . import placement
from .files import FileMetadata
from .killed import Departures, OomKills
from .reads import BlockReads
from .silent import SilentWorkers

CLAIM_SECONDS = 120  # a creator that sent nothing for this long is presumed gone


class DatasetState:
    """One dataset on the scheduler."""

    def __init__(self, name: str, claimant: str):
        self.name = name
        self.claimant = claimant
        self.claimed_at = time.monotonic()
        self.info: DatasetInfo | None = None
        self.planned: list[str | None] = []  # worker address per block
        self.priority: list[int] = []  # higher loads first
        self.ready = asyncio.Event()  # set once the blocks exist on the scheduler (or the claim is dropped)
        self.loaded = 0  # blocks in memory somewhere
        self.changes = 0  # blocks that came into or left memory, ever (`BlockReads.locate_ready`)
        self.erred: set = set()  # block indices whose load failed
        self.forgotten = 0  # its blocks the scheduler forgot once all were submitted (`client.restart()`)
        self.lazy = False  # blocks are submitted when first wanted, not at creation
        self.groups: Groups | None = None  # its load groups (`dmdask.plan.groups`); None: a task per block
        self.holders: set[str] = set()  # Dask client ids that opened it (`Release`)
        self.creator: str | None = None  # the claimant's Dask client id (`remove_client`)
        self.submitted = 0  # block loads the scheduler took in for it, counted per graph (`Submitted`)
        self.submitting = False  # ready, some blocks not submitted yet
        self.wanted: set[int] = set()  # blocks ranks asked for before they were submitted
        self.arrived = asyncio.Event()  # set at each graph of its blocks taken in
        self.progressed = asyncio.Event()  # set as its blocks load or fail, or a rank wants one (`Submitted.ahead`)

    @property
    def unfinished(self) -> int:
        """Its submitted loads neither in memory nor failed."""
        return self.submitted - self.loaded - len(self.erred)

    @property
    def identity(self) -> str | None:
        return None if self.info is None else self.info.identity

    @property
    def holder_client(self) -> str:
        """The pseudo-client that keeps the blocks alive."""
        return f"dmdask-dataset-{self.name}"

    def keys(self) -> list[str]:
        """The keys of its load tasks: one per block, or per load group."""
        if self.groups is not None:
            return [group_key(self.identity, g) for g in range(self.groups.count)]
        return [block_key(self.identity, k) for k in range(len(self.planned))]

    def task_key(self, k: int) -> str:
        """The key of the task that loads block k: its own, or its load group's."""
        return block_key(self.identity, k) if self.groups is None else group_key(self.identity, self.groups.of(k))

    def summary(self) -> DatasetSummary:
        info = self.info
        return DatasetSummary(self.name, info and redact(info.url), info and info.identity, info and info.num_samples,
                              len(self.planned), info and info.nbytes, self.loaded, len(self.erred),
                              self.ready.is_set())


class DatasetsPlugin(SchedulerPlugin):
    """Registered by `dask scheduler --preload dmdask.dashboard` (page and plugin) or by
    the first `dmdask.batches` call (idempotent)."""

    name = "dmdask"
    idempotent = True

    def __init__(self):
        self.scheduler = None
        self.datasets: dict[str, DatasetState] = {}
        self.by_identity: dict[str, DatasetState] = {}
        self.files = FileMetadata()
        self.reads = BlockReads(self)
        self.streamed: set = set()  # keys of blocks held as `Streamed` markers (`placement.STREAMED_TOPIC`)
        self._next_lazy = 0  # where the next lazy dataset's plan starts (round-robin)
        self.oom_kills = OomKills()  # what the workers that start block loads report (`WorkerKilledError`)
        self.departures = Departures()  # the workers that left on purpose (`LeftOnPurpose`)
        self.silent = SilentWorkers()  # workers that stopped heartbeating, treated as lost

    async def start(self, scheduler) -> None:
        """Install the handlers. Two clients registering the plugin at once may both start
        one: the later one then shares the registry of the one already installed."""
        if self.scheduler is not None:
            return
        installed = scheduler.extensions.get("dmdask")
        if isinstance(installed, DatasetsPlugin):
            self.datasets, self.by_identity, self.files = installed.datasets, installed.by_identity, installed.files
            self.reads, self.streamed, self.oom_kills = installed.reads, installed.streamed, installed.oom_kills
            self.departures, self.silent = installed.departures, installed.silent
        self.scheduler = scheduler
        self.silent.start(scheduler)
        reads = self.reads
        scheduler.handlers.update(serve({
            GetOrClaim: self.get_or_claim, Register: self.register, Submitted: self.submitted, GetOrRegister: self.get_or_register,
            Abandon: self.abandon, Release: self.release_held,
            Datasets: lambda request: self.summaries(), Locate: reads.locate, OpenBlocks: reads.open_blocks,
            Workers: lambda request: [a for a in request.addresses if a in self.scheduler.workers],
            LeftOnPurpose: lambda request: self.departures.left_on_purpose(request.worker),
            FsMetadata: reads.fs_metadata, FsClaim: reads.fs_claim, FsOpenBlocks: reads.fs_open_blocks,
            FsHeld: reads.fs_held}))
        scheduler.extensions["dmdask"] = self
        from distributed.protocol.pickle import dumps

        from ..worker.plugin import WorkerPlugin  # the workers' side (their cache and handlers), as shuffle does

        await scheduler.register_worker_plugin(None, dumps(WorkerPlugin()), name=WorkerPlugin.name, idempotent=True)

    # -- get or create ---------------------------------------------------------------
    async def get_or_claim(self, request: GetOrClaim) -> Ready | Claimed:
        name, claimant = request.name, request.claimant
        while True:
            ds = self.datasets.get(name)
            if ds is None:
                ds = self.datasets[name] = DatasetState(name, claimant)
                ds.creator = request.client
                self._hold(ds, request.client)
                return Claimed()
            self._hold(ds, request.client)
            if ds.ready.is_set() and not self._lost(ds):
                ready = self._ready(ds)
                return ready if request.host is None else await self.reads.locate_ready(ready, request.host)
            if ds.ready.is_set():  # its blocks were forgotten (`client.restart()`): create them again
                self._forget(ds)
                continue
            if ds.claimant == claimant and ds.info is None:  # its holder asks again before registering
                return Claimed()
            left = CLAIM_SECONDS - (time.monotonic() - ds.claimed_at)
            if left <= 0:  # its creator is gone: the caller takes the claim over
                ds.claimant, ds.claimed_at, ds.creator = claimant, time.monotonic(), request.client
                return Claimed()
            with contextlib.suppress(asyncio.TimeoutError):  # then look again (abandoned: claim it afresh)
                await asyncio.wait_for(asyncio.shield(ds.ready.wait()), timeout=left)

    def register(self, request: Register) -> Registered | Busy | NoWorkers:
        """A lazy dataset is ready now and its plan starts where the previous lazy one's stopped."""
        info, order = request.info, request.order
        ds = self.datasets.get(request.name)
        if ds is None or ds.claimant != request.claimant:
            return Busy()
        workers = sorted(self.scheduler.workers)
        if not workers:
            return NoWorkers()
        first = self._next_lazy if request.lazy else 0
        ds.info = info
        size = group_size(info.num_blocks, request.lazy)
        ds.groups = Groups(info.num_blocks, order, size) if size > 1 else None
        placement.plan(ds, workers, order, first, size)
        self.by_identity[info.identity] = ds
        ds.claimed_at = time.monotonic()
        if request.lazy:
            self._next_lazy = (first + info.num_blocks) % len(workers)
            ds.lazy = True
            ds.ready.set()
        return Registered()

    async def submitted(self, request: Submitted) -> Wanted | Busy:
        """The claimant's chunk of loads is in (or `timeout` passed): the dataset is ready,
        still submitting unless `done`; the blocks ranks asked for meanwhile, to submit next."""
        ds = self.datasets.get(request.name)
        if ds is None or ds.claimant != request.claimant or ds.info is None:
            return Busy()
        deadline = time.monotonic() + request.timeout
        while ds.submitted < request.count and time.monotonic() < deadline:
            ds.arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ds.arrived.wait(), deadline - time.monotonic())
        ds.submitting = not request.done
        ds.creator = request.client or ds.creator
        ds.claimed_at = time.monotonic()
        ds.ready.set()
        if request.ahead is None:
            wanted, ds.wanted = sorted(ds.wanted), set()
            return Wanted(wanted)
        while ds.unfinished > request.ahead and not ds.wanted and time.monotonic() < deadline:
            ds.progressed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ds.progressed.wait(), deadline - time.monotonic())
        ds.claimed_at = time.monotonic()
        wanted, ds.wanted = sorted(ds.wanted), set()
        return Wanted(wanted, request.ahead - ds.unfinished)

    def unsubmitted(self, key: str) -> bool:
        """Whether `key` is a block of a dataset still being submitted, whose load is not
        submitted yet (the scheduler has no task of it): noted as wanted (`Wanted`)."""
        parsed = parse_block_key(key)
        ds = parsed and self.by_identity.get(parsed[0])
        if not ds or not ds.submitting or not 0 <= parsed[1] < len(ds.planned):
            return False
        ds.wanted.add(parsed[1])
        ds.progressed.set()
        return True

    def get_or_register(self, request: GetOrRegister) -> Ready | Registered | Busy | NoWorkers:
        """For datasets whose description needs no I/O (transparent mode's files)."""
        info = request.info
        ds = self.datasets.get(info.name)
        if ds is not None and ds.ready.is_set() and ds.info is not None:
            return self._ready(ds)
        if ds is not None:
            return Busy()
        claimant = f"dmdask-register-{info.name}"
        self.datasets[info.name] = DatasetState(info.name, claimant)
        reply = self.register(Register(info.name, claimant, info, lazy=True))
        if not isinstance(reply, Registered):
            self._forget(self.datasets[info.name])
        return reply

    def abandon(self, request: Abandon) -> None:
        """Drop a claim whose holder could not create the dataset (waiters claim it next)."""
        ds = self.datasets.get(request.name)
        if ds is not None and ds.claimant == request.claimant and not ds.ready.is_set():
            self._forget(ds)
            ds.ready.set()

    def update_graph(self, scheduler, *, client: str, keys, tasks=(), stimulus_id=None, **kwargs) -> None:
        """Pin the new block tasks of a registered dataset to their planned workers before
        they are first scheduled, and have the dataset's pseudo-client want them."""
        wanted: dict[DatasetState, list] = defaultdict(list)
        blocks_in: dict[DatasetState, int] = defaultdict(int)
        restrictions = {}
        for key in tasks:
            ds, blocks = self._task(key)
            if not ds:
                continue
            k = blocks[0]
            self.reads.claims.pop(key, None)  # handed over: the task is the block's entry from now on
            wanted[ds].append(key)
            blocks_in[ds] += len(blocks)
            ts = scheduler.tasks[key]
            if ts.state == "released" and not ts.worker_restrictions:
                restrictions[key] = {placement.live_planned(scheduler, ds, k, blocks)}
                load_first(ts, ds.priority[k])
        if restrictions:
            scheduler.set_restrictions(restrictions)
        for ds, ds_keys in wanted.items():
            scheduler.client_desires_keys(keys=ds_keys, client=ds.holder_client)
            ds.submitted += blocks_in[ds]
            ds.arrived.set()
            if blocks_in[ds] == len(ds.planned):  # every block in one graph
                ds.submitting = False
                ds.ready.set()

    def remove_client(self, scheduler, client: str) -> None:
        """A reader's claims pass on; a dataset whose claimant left before it submitted every
        block is treated as lost (`_lost`): the next open submits the missing blocks."""
        self.reads.remove_client(client)
        for ds in self.datasets.values():
            if ds.submitting and ds.creator == client:
                ds.submitting = False
                ds.forgotten += 1

    def _task(self, key) -> tuple[DatasetState | None, list[int]]:
        """(the dataset whose load task `key` is, the blocks it loads), or (None, [])."""
        if isinstance(key, str) and key.startswith(GROUP_KEY_PREFIX):
            parsed = parse_group_key(key)
            ds = parsed and self.by_identity.get(parsed[0])
            if ds and ds.groups is not None and 0 <= parsed[1] < ds.groups.count:
                return ds, ds.groups.members(parsed[1])
            return None, []
        parsed = parse_block_key(key)
        ds = parsed and self.by_identity.get(parsed[0])
        return (ds, [parsed[1]]) if ds and ds.groups is None else (None, [])

    def task_key(self, key: str) -> str:
        """The key of the task that loads block `key`: a load group's, or the block's own."""
        parsed = parse_block_key(key)
        ds = parsed and self.by_identity.get(parsed[0])
        if ds and ds.groups is not None and 0 <= parsed[1] < len(ds.planned):
            return ds.task_key(parsed[1])
        return key

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if not (isinstance(key, str) and key.startswith((BLOCK_KEY_PREFIX, GROUP_KEY_PREFIX))):
            return
        ds, blocks = self._task(key)
        if finish == "processing" and ds is not None:
            ts = self.scheduler.tasks.get(key)
            if ts is not None and ts.processing_on is not None:
                self.oom_kills.seen(ts.processing_on)
        if ds is not None:
            if finish == "memory":
                ds.loaded += len(blocks)
            elif start == "memory":
                ds.loaded -= len(blocks)
            ds.changes += finish == "memory" or start == "memory"
            if finish == "forgotten" and ds.ready.is_set():
                ds.forgotten += 1
            if finish == "erred":
                ds.erred.update(blocks)
            elif start == "erred":
                ds.erred.difference_update(blocks)
            if finish in ("memory", "erred"):
                ds.progressed.set()
        if finish in ("processing", "memory", "erred", "forgotten", "released"):  # processing: `Locate.planned`
            self.reads.waiters.wake(key)
        if finish in ("erred", "forgotten", "released"):
            self.streamed.discard(key)

    def log_event(self, topic: str, msg) -> None:
        """A worker holds block `msg` as a `Streamed` marker (kept while its task is alive);
        a worker leaves on purpose (`Departures`)."""
        self.departures.event(topic, msg)
        ts = self.scheduler.tasks.get(msg) if topic == placement.STREAMED_TOPIC else None
        if ts is not None and ts.state in ("processing", "memory"):
            self.streamed.add(msg)

    def _hold(self, ds: DatasetState, client: str | None) -> None:
        """`client` holds `ds` from now on (clients no longer connected are forgotten)."""
        connected = self.scheduler.clients
        ds.holders = {c for c in ds.holders if c in connected}
        if client in connected:
            ds.holders.add(client)

    def _lost(self, ds: DatasetState) -> bool:
        """Whether the scheduler forgot any block of a ready dataset. O(1), so that every
        rank's open costs the scheduler the same whatever the number of blocks: a block's
        task leaves the scheduler only through the transition to "forgotten", which
        `transition` counts (looking every key up cost 29 ms a rank at 10^5 blocks)."""
        return ds.info is not None and not ds.lazy and ds.forgotten > 0

    def _forget(self, ds: DatasetState) -> None:
        self.datasets.pop(ds.name, None)
        self.reads.forget_layouts(dataset=ds.name)
        if ds.identity and self.by_identity.get(ds.identity) is ds:
            del self.by_identity[ds.identity]

    def _ready(self, ds: DatasetState) -> Ready:
        """The answer for a dataset that exists; its erred blocks are retried (a repaired
        file is read again)."""
        keys = [key for key in {ds.task_key(k) for k in ds.erred} if key in self.scheduler.tasks]
        if keys:
            self.scheduler.stimulus_retry(keys=keys, client=ds.holder_client)
        return Ready(ds.info, ds.loaded)

    # -- workers come and go -----------------------------------------------------------
    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kwargs) -> None:
        """Plan the blocks of a worker that left over the workers present."""
        self.reads.forget_layouts(worker=worker)
        self.silent.left(worker)
        placement.replan(scheduler, self.datasets.values(), lambda address: address == worker, stimulus_id)

    def add_worker(self, scheduler, worker: str) -> None:
        """Blocks whose planned worker is gone (every worker left at once) go to the workers
        present; blocks streamed for want of room move to the new worker, up to its room."""
        self.departures.joined(worker)
        live = scheduler.workers
        stimulus_id = f"dmdask-add-worker-{time.time()}"
        placement.replan(scheduler, self.datasets.values(), lambda address: address not in live, stimulus_id)
        placement.win_back(scheduler, self.datasets.values(), self.streamed, worker, stimulus_id)

    # -- release and the registry --------------------------------------------------------
    def release_held(self, request: Release) -> bool | Held:
        """`release`, for a client that holds the dataset or when none of its holders is
        connected; else `Held` (nothing changed): a client cannot drop what others read."""
        ds = self.datasets.get(request.name)
        others = set() if ds is None else (ds.holders & set(self.scheduler.clients)) - {request.client}
        if others and request.client not in ds.holders:
            return Held(len(others))
        return self.release(request.name)

    def release(self, name: str) -> bool:
        """Forget a dataset: its blocks leave every tier now; an iterator still reading it
        fails with `NotADmdaskWorker` (released)."""
        ds = self.datasets.get(name)
        if ds is None:
            return False
        self._forget(ds)
        keys = [k for k in ds.keys() if k in self.scheduler.tasks] if ds.identity else []
        if keys and ds.holder_client in self.scheduler.clients:  # a lazy dataset may have no block loaded
            self.scheduler.client_releases_keys(keys=keys, client=ds.holder_client,
                                                stimulus_id=f"dmdask-release-{time.time()}")
        ds.ready.set()
        return True

    def summaries(self) -> list[DatasetSummary]:
        """One summary per dataset (name, url, samples, blocks, loaded, erred, ...)."""
        return [ds.summary() for ds in self.datasets.values()]
