"""`DatasetsPlugin`: dmdask's scheduler side, the one owner of every dataset's blocks.

It keeps a registry (dataset name -> description, blocks, planned worker of each block),
hands out get-or-create claims so a dataset is listed and created once per cluster
whatever the number of ranks and jobs, pins each block load to its planned worker, keeps
the blocks alive for the cluster (a pseudo-client wants them, as Dask's published
datasets do) and releases them.

Guarantees:
- get-or-create is race-free: all handlers run on the scheduler's event loop; one caller
  at a time holds the claim to create a dataset, the others wait for it (a claim whose
  holder vanished is handed on after `CLAIM_SECONDS`).
- a block's load runs on its planned worker: the task is restricted to that worker
  (strict restrictions, which Dask's work stealing never moves), set before the task is
  first scheduled; when that worker leaves, its unfinished and lost blocks are planned
  again over the workers present, and blocks left with no live planned worker (every
  worker gone at once) are planned over the next worker that joins.
- blocks outlive the jobs that read them until `release`.
- lazy datasets (`get_or_register`, or `register(..., lazy=True)`; transparent mode's
  files): ready once registered, with every block planned; a block's load task is submitted by whoever
  first wants it (and again after the scheduler forgot it), and pinned like any other.
  Their blocks are planned round-robin from where the previous lazy dataset stopped,
  so many one-block files spread over the workers.
- a lazy block nobody holds is read from the store by one reader at a time
  (`open_blocks`): the first reader to ask claims it, reads it itself and hands the
  bytes to the planned worker with the block's load task; the others wait for that
  task. A claim ends when the task arrives or its reader's client leaves (then the
  next reader to ask loads the block).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Dict, List, Optional

from distributed.comm import get_address_host
from distributed.diagnostics.plugin import SchedulerPlugin

from .. import arguments as check
from ..internals import held_type, load_first, task_error
from ..source.base import block_key, parse_block_key
from .files import FileMetadata

logger = logging.getLogger(__name__)

CLAIM_SECONDS = 120  # a creator that sent nothing for this long is presumed gone
LOCATE_LONGEST = 60.0  # the longest a `locate` call may wait


class DatasetState:
    """One dataset on the scheduler."""

    def __init__(self, name: str, claimant: str):
        self.name = name
        self.claimant = claimant
        self.claimed_at = time.monotonic()
        self.info: Optional[dict] = None
        self.planned: List[Optional[str]] = []  # worker address per block
        self.priority: List[int] = []  # higher loads first
        self.ready = asyncio.Event()  # set once the blocks exist on the scheduler (or the claim is dropped)
        self.loaded = 0  # blocks in memory somewhere
        self.erred: set = set()  # block indices whose load failed
        self.lazy = False  # blocks are submitted when first wanted, not at creation

    @property
    def identity(self) -> Optional[str]:
        return None if self.info is None else self.info["identity"]

    @property
    def holder_client(self) -> str:
        """The pseudo-client that keeps the blocks alive."""
        return f"dmdask-dataset-{self.name}"

    def keys(self) -> List[str]:
        return [block_key(self.identity, k) for k in range(len(self.planned))]

    def summary(self) -> dict:
        info = self.info or {}
        return {"name": self.name, "url": info.get("url"), "identity": info.get("identity"),
                "samples": info.get("num_samples"), "blocks": len(self.planned), "nbytes": info.get("nbytes"),
                "loaded": self.loaded, "erred": len(self.erred), "ready": self.ready.is_set()}


class DatasetsPlugin(SchedulerPlugin):
    """The `dmdask` scheduler plugin; see the module docstring. Register it with
    `dask scheduler --preload dmdask.dashboard` (page and plugin) or let the first
    `dmdask.batches` call register it (idempotent)."""

    name = "dmdask"
    idempotent = True

    def __init__(self):
        self.scheduler = None
        self.datasets: Dict[str, DatasetState] = {}
        self.by_identity: Dict[str, DatasetState] = {}
        self._waiters: Dict[str, List[asyncio.Future]] = defaultdict(list)
        self.files = FileMetadata()
        self._next_lazy = 0  # where the next lazy dataset's plan starts (round-robin)
        self.claims: Dict[str, str] = {}  # block key -> the client reading it from the store (`open_blocks`)

    async def start(self, scheduler) -> None:
        """Install the handlers. Two clients registering the plugin at once may both start
        one: the later one then shares the registry of the one already installed."""
        if self.scheduler is not None:
            return
        installed = scheduler.extensions.get("dmdask")
        if isinstance(installed, DatasetsPlugin):
            self.datasets, self.by_identity, self._waiters = installed.datasets, installed.by_identity, installed._waiters
            self.files = installed.files
            self.claims = installed.claims
        self.scheduler = scheduler
        scheduler.handlers.update({
            "dmdask_get_or_claim": self.get_or_claim,
            "dmdask_register": self.register,
            "dmdask_get_or_register": self.get_or_register,
            "dmdask_abandon": self.abandon,
            "dmdask_locate": self.locate,
            "dmdask_open_blocks": self.open_blocks,
            "dmdask_release": self.release,
            "dmdask_datasets": self.summaries,
            "dmdask_fs_metadata": self.files.handler,
            "dmdask_fs_claim": self.fs_claim,
            "dmdask_fs_open_blocks": self.fs_open_blocks,
        })
        scheduler.extensions["dmdask"] = self
        from distributed.protocol.pickle import dumps

        from ..worker.plugin import WorkerPlugin  # the workers' side (their cache and handlers), as shuffle does

        await scheduler.register_worker_plugin(None, dumps(WorkerPlugin()), name=WorkerPlugin.name, idempotent=True)

    # -- get or create ---------------------------------------------------------------
    async def get_or_claim(self, name: str, claimant: str) -> dict:
        """{"status": "ready", "info": ..., "loaded": blocks held now} when the dataset
        exists (erred blocks are retried, so a repaired file is read again), else
        {"status": "claimed"}: the caller must list the source, `register` it and submit
        its blocks."""
        check.text("dmdask_get_or_claim", "name", name)
        check.text("dmdask_get_or_claim", "claimant", claimant)
        while True:
            ds = self.datasets.get(name)
            if ds is None:
                self.datasets[name] = DatasetState(name, claimant)
                return {"status": "claimed"}
            if ds.ready.is_set() and not self._lost(ds):
                self._retry_erred(ds)
                return {"status": "ready", "info": ds.info, "loaded": ds.loaded}
            if ds.ready.is_set():  # its blocks were forgotten (`client.restart()`): create them again
                self._forget(ds)
                continue
            if ds.claimant == claimant and ds.info is None:  # its holder asks again before registering
                return {"status": "claimed"}
            left = CLAIM_SECONDS - (time.monotonic() - ds.claimed_at)
            if left <= 0:  # its creator is gone: the caller takes the claim over
                ds.claimant, ds.claimed_at = claimant, time.monotonic()
                return {"status": "claimed", "info": ds.info}
            try:
                await asyncio.wait_for(asyncio.shield(ds.ready.wait()), timeout=left)
            except asyncio.TimeoutError:
                pass
            if self.datasets.get(name) is not ds:  # abandoned: claim it afresh
                continue

    def register(self, name: str, claimant: str, info: dict, order: Optional[List[int]] = None,
                 lazy: bool = False) -> dict:
        """Plan the blocks of a claimed dataset: the i-th block of `order` (the order the
        blocks are first needed; None: index order) goes to worker i mod W and loads with
        priority -i. A lazy dataset is ready now (its blocks come when first wanted) and
        its plan starts where the previous lazy dataset's stopped."""
        check.text("dmdask_register", "name", name)
        check.text("dmdask_register", "claimant", claimant)
        check.dataset_info("dmdask_register", info)
        check.block_order("dmdask_register", order, -(-info["num_samples"] // info["block_len"]))
        check.flag("dmdask_register", "lazy", lazy)
        ds = self.datasets.get(name)
        if ds is None or ds.claimant != claimant:
            return {"status": "not-claimed"}
        workers = sorted(self.scheduler.workers)
        if not workers:
            return {"status": "no-workers"}
        n = -(-info["num_samples"] // info["block_len"]) if order is None else len(order)
        first = self._next_lazy if lazy else 0
        ds.info = info
        ds.planned = [None] * n
        ds.priority = [0] * n
        for i, k in enumerate(range(n) if order is None else order):
            ds.planned[k] = workers[(first + i) % len(workers)]
            ds.priority[k] = n - i
        self.by_identity[info["identity"]] = ds
        ds.claimed_at = time.monotonic()
        if lazy:
            self._next_lazy = (first + n) % len(workers)
            ds.lazy = True
            ds.ready.set()
        return {"status": "OK"}

    def get_or_register(self, name: str, info: dict) -> dict:
        """A lazy dataset whose description needs no I/O (transparent mode's files), in one
        request: {"status": "ready", "info"} when it exists (erred blocks are retried), else
        registered now: {"status": "created"} (none of its blocks exists yet), or
        {"status": "no-workers"}; {"status": "busy"} while another caller creates it."""
        check.text("dmdask_get_or_register", "name", name)
        check.dataset_info("dmdask_get_or_register", info)
        ds = self.datasets.get(name)
        if ds is not None and ds.ready.is_set() and ds.info is not None:
            self._retry_erred(ds)
            return {"status": "ready", "info": ds.info}
        if ds is not None:
            return {"status": "busy"}
        claimant = f"dmdask-register-{name}"
        self.datasets[name] = DatasetState(name, claimant)
        reply = self.register(name, claimant, info, lazy=True)
        if reply["status"] != "OK":
            self._forget(self.datasets[name])
            return reply
        return {"status": "created"}

    def open_blocks(self, datasets: List[list], keys: List[str], client: str, host: Optional[str] = None) -> dict:
        """A reader's first look at blocks of lazy datasets, in one request. `datasets`:
        [name, info] of each, registered now when new. Answers {"status": "OK",
        "holders": {key: address} (a holder on `host` preferred), "erred": {key:
        exception}, "mine": {key: planned worker} (claimed for `client`: it reads them
        from the store and submits their loads), "pending": [keys being loaded, or read
        by another reader: `locate` waits for them], "unknown": [keys of datasets being
        created otherwise]}, or {"status": "no-workers"}."""
        handler = "dmdask_open_blocks"
        if not isinstance(datasets, (list, tuple)) or not all(
                isinstance(d, (list, tuple)) and len(d) == 2 for d in datasets):
            raise check.refuse(handler, "datasets", "a list of [name, info] pairs", datasets)
        for name, info in datasets:
            check.text(handler, "datasets name", name)
            check.dataset_info(handler, info)
        check.texts(handler, "keys", keys)
        check.text(handler, "client", client)
        check.text(handler, "host", host, optional=True)
        for name, info in datasets:
            if self.get_or_register(name, info)["status"] == "no-workers":
                return {"status": "no-workers"}
        holders, erred, mine, pending, unknown = {}, {}, {}, [], []
        for key in keys:
            ts = self.scheduler.tasks.get(key)
            parsed = parse_block_key(key)
            ds = parsed and self.by_identity.get(parsed[0])
            if ts is not None and ts.state == "memory" and ts.who_has:
                holders[key] = _holder(ts, host)
            elif ts is not None and ts.state == "erred":
                erred[key] = task_error(ts)
            elif ts is not None or self._claimed(key):
                pending.append(key)
            elif not ds or not ds.lazy:
                unknown.append(key)
            else:
                self.claims[key] = client
                mine[key] = self._live_planned(ds, parsed[1])
        return {"status": "OK", "holders": holders, "erred": erred, "mine": mine, "pending": pending,
                "unknown": unknown}

    def fs_claim(self, run: str, claim: List[list]) -> dict:
        """Transparent mode's look before reading new files from the store: {"status":
        "no-workers"} while the cluster has none (nothing claimed: the caller waits for
        one), else {"status": "OK"} with `FileMetadata.handler`'s answer to `claim`
        ([folder, path] of infos the caller is to read with their first blocks)."""
        check.text("dmdask_fs_claim", "run", run)
        check.tuples("dmdask_fs_claim", "claim", claim, 2, leading_texts=2)
        if not self.scheduler.workers:
            return {"status": "no-workers"}
        return {"status": "OK", **self.files.handler(run, claim=claim)}

    def fs_open_blocks(self, run: str, put: List[list], datasets: List[list], keys: List[str], client: str,
                       host: Optional[str] = None) -> dict:
        """After a reader read claimed files' first blocks with their infos (`fs_claim`),
        one request does `open_blocks` on those blocks and shares the infos with `run`
        (`put`: [folder, "info", path, info], which ends the claims), at once: a reader of
        the run that waited for an info finds its block claimed, and waits for that."""
        check.text("dmdask_fs_open_blocks", "run", run)
        check.tuples("dmdask_fs_open_blocks", "put", put, 4, leading_texts=3)
        if not all(p[1] == "info" and isinstance(p[3], dict) for p in put):
            raise check.refuse("dmdask_fs_open_blocks", "put", "[folder, 'info', path, info dict] lists", put)
        reply = self.open_blocks(datasets, keys, client, host)  # checks its arguments before any change
        self.files.handler(run, put=put)
        return reply

    def _claimed(self, key: str) -> bool:
        """Whether a live client is reading this block from the store."""
        return self.claims.get(key) in self.scheduler.clients

    def remove_client(self, scheduler, client: str) -> None:
        """A reader left: the blocks it claimed and never handed over go to the next reader."""
        dropped = [key for key, holder in self.claims.items() if holder == client]
        for key in dropped:
            del self.claims[key]
            for fut in self._waiters.pop(key, ()):
                if not fut.done():
                    fut.set_result("released")

    def abandon(self, name: str, claimant: str) -> None:
        """Drop a claim whose holder could not create the dataset (waiters claim it next)."""
        check.text("dmdask_abandon", "name", name)
        check.text("dmdask_abandon", "claimant", claimant)
        ds = self.datasets.get(name)
        if ds is not None and ds.claimant == claimant and not ds.ready.is_set():
            self._forget(ds)
            ds.ready.set()

    def update_graph(self, scheduler, *, client: str, keys, tasks=(), stimulus_id=None, **kwargs) -> None:
        """Pin the new block tasks of a registered dataset to their planned workers before
        they are first scheduled, and have the dataset's pseudo-client want them."""
        wanted: Dict[DatasetState, list] = defaultdict(list)
        restrictions = {}
        for key in tasks:
            parsed = parse_block_key(key)
            ds = parsed and self.by_identity.get(parsed[0])
            if not ds:
                continue
            k = parsed[1]
            self.claims.pop(key, None)  # handed over: the task is the block's entry from now on
            wanted[ds].append(key)
            ts = scheduler.tasks[key]
            if ts.state == "released" and not ts.worker_restrictions:
                restrictions[key] = {self._live_planned(ds, k)}
                load_first(ts, ds.priority[k])
        if restrictions:
            scheduler.set_restrictions(restrictions)
        for ds, ds_keys in wanted.items():
            scheduler.client_desires_keys(keys=ds_keys, client=ds.holder_client)
            if len(ds_keys) == len(ds.planned):
                ds.ready.set()

    def _live_planned(self, ds: DatasetState, k: int) -> str:
        worker = ds.planned[k]
        if worker not in self.scheduler.workers:
            live = sorted(self.scheduler.workers)
            if live:
                worker = ds.planned[k] = live[k % len(live)]
        return worker

    # -- where the blocks are ----------------------------------------------------------
    async def locate(self, keys: List[str], host: Optional[str] = None, timeout: float = 2.0,
                     expect: List[str] = (), planned: bool = False) -> dict:
        """{"holders": {key: address}, "erred": {key: exception}, "unknown": [keys]} once every
        key is held or erred, or after `timeout` seconds with what is known then. A holder on
        `host` is preferred. Never raises for a missing key: it is reported as unknown, but
        keys in `expect` (just submitted by the caller, on another connection) and keys a live
        reader claimed (`open_blocks`) are waited for like keys still loading. planned: a
        block being loaded right now is not waited for but named in "planned" with the
        worker loading it (it holds the block in a moment: `dmdask_rows` waits for it)."""
        check.texts("dmdask_locate", "keys", keys)
        check.text("dmdask_locate", "host", host, optional=True)
        check.number("dmdask_locate", "timeout", timeout, 0, LOCATE_LONGEST)
        check.texts("dmdask_locate", "expect", expect)
        check.flag("dmdask_locate", "planned", planned)
        deadline = time.monotonic() + timeout
        expect = set(expect)
        while True:
            holders, erred, pending, unknown, loading = {}, {}, [], [], {}
            for key in keys:
                ts = self.scheduler.tasks.get(key)
                if ts is None:
                    (pending if key in expect or self._claimed(key) else unknown).append(key)
                elif ts.state == "memory" and ts.who_has:
                    holders[key] = _holder(ts, host)
                elif ts.state == "erred":
                    erred[key] = task_error(ts)
                elif planned and ts.state == "processing" and ts.processing_on is not None:
                    loading[key] = ts.processing_on.address
                else:
                    pending.append(key)
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return {"holders": holders, "erred": erred, "unknown": unknown, "pending": pending,
                        "planned": loading}
            waiters = []
            for key in pending:
                fut = asyncio.get_running_loop().create_future()
                self._waiters[key].append(fut)
                waiters.append(fut)
            await asyncio.wait(waiters, timeout=left, return_when=asyncio.ALL_COMPLETED)
            for key, fut in zip(pending, waiters):
                if not fut.done():
                    fut.cancel()
                    if fut in self._waiters.get(key, ()):
                        self._waiters[key].remove(fut)
                        if not self._waiters[key]:
                            del self._waiters[key]

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        parsed = parse_block_key(key)
        if parsed is None:
            return
        ds = self.by_identity.get(parsed[0])
        if ds is not None:
            if finish == "memory":
                ds.loaded += 1
            elif start == "memory":
                ds.loaded -= 1
            if finish == "erred":
                ds.erred.add(parsed[1])
            elif start == "erred":
                ds.erred.discard(parsed[1])
        if finish in ("memory", "erred", "forgotten", "released"):
            for fut in self._waiters.pop(key, ()):
                if not fut.done():
                    fut.set_result(finish)

    def _lost(self, ds: DatasetState) -> bool:
        """Whether the scheduler forgot any block of a ready dataset."""
        tasks = self.scheduler.tasks
        return ds.info is not None and not ds.lazy and any(key not in tasks for key in ds.keys())

    def _forget(self, ds: DatasetState) -> None:
        self.datasets.pop(ds.name, None)
        if ds.identity and self.by_identity.get(ds.identity) is ds:
            del self.by_identity[ds.identity]

    def _retry_erred(self, ds: DatasetState) -> None:
        keys = [block_key(ds.identity, k) for k in ds.erred
                if self.scheduler.tasks.get(block_key(ds.identity, k)) is not None]
        if keys:
            self.scheduler.stimulus_retry(keys=keys, client=ds.holder_client)

    # -- workers come and go -----------------------------------------------------------
    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kwargs) -> None:
        """Plan the blocks of a worker that left over the workers present."""
        self._replan(lambda address: address == worker, stimulus_id)

    def add_worker(self, scheduler, worker: str) -> None:
        """Blocks whose planned worker is gone (every worker left at once) go to the workers
        present; blocks streamed for want of room move to the new worker, up to its room."""
        live = scheduler.workers
        stimulus_id = f"dmdask-add-worker-{time.time()}"
        self._replan(lambda address: address not in live, stimulus_id)
        self._win_back(worker, stimulus_id)

    def _win_back(self, worker: str, stimulus_id: str) -> None:
        """Capacity lost with a worker comes back when one joins: blocks held as `Streamed`
        markers (their holders had no room; read from the store every epoch) are loaded
        again on the new worker, as many as its free room (from its dmdask metrics) takes.
        Each costs one read now, in place of the next epoch's stream read."""
        ws = self.scheduler.workers.get(worker)
        tiers = (ws.metrics.get("dmdask") if ws is not None else None) or {}
        room = sum(max(0, t.get("capacity", 0) - t.get("bytes", 0) - t.get("reserved", 0))
                   for name, t in tiers.items() if name in ("ram", "ssd") and not t.get("error"))
        moved = []
        for ds in self.datasets.values():
            if ds.info is None or not ds.info.get("nbytes"):
                continue
            per_block = ds.info["nbytes"] / max(1, len(ds.planned))
            for k in range(len(ds.planned)):
                key = block_key(ds.identity, k)
                ts = self.scheduler.tasks.get(key)
                if ts is None or ts.state != "memory" or not held_type(ts).endswith(".Streamed"):
                    continue
                if room < per_block:
                    break
                room -= per_block
                ds.planned[k] = worker
                moved.append(key)
        if moved:
            logger.info("moving %d streamed blocks to the new worker %s", len(moved), worker)
            self.scheduler.set_restrictions({key: {worker} for key in moved})
            self.scheduler.transitions({key: "released" for key in moved}, stimulus_id)

    def _replan(self, orphaned, stimulus_id: str) -> None:
        live = sorted(self.scheduler.workers)
        if not live:
            return
        restrictions, recommendations = {}, {}
        i = 0
        for ds in self.datasets.values():
            for k, worker in enumerate(ds.planned):
                if worker is None or not orphaned(worker):
                    continue
                ds.planned[k] = worker = live[i % len(live)]
                i += 1
                key = block_key(ds.identity, k)
                ts = self.scheduler.tasks.get(key)
                if ts is None or ts.state == "memory":
                    continue
                restrictions[key] = {worker}
                if ts.state == "no-worker":
                    recommendations[key] = "processing"
        if restrictions:
            self.scheduler.set_restrictions(restrictions)
        if recommendations:
            self.scheduler.transitions(recommendations, stimulus_id)

    # -- release and the registry --------------------------------------------------------
    def release(self, name: str) -> bool:
        """Forget a dataset: its blocks leave every tier now; an iterator still reading it
        fails with `NotADmdaskWorker` (released)."""
        check.text("dmdask_release", "name", name)
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

    def summaries(self) -> List[dict]:
        """One summary per dataset (name, url, samples, blocks, loaded, erred, ...)."""
        return [ds.summary() for ds in self.datasets.values()]


def _holder(ts, host: Optional[str]) -> str:
    """A worker holding the task's result, one on `host` if any."""
    addresses = sorted(ws.address for ws in ts.who_has)
    local = [a for a in addresses if host and get_address_host(a) == host]
    return (local or addresses)[0]

