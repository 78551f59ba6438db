"""`BlockReads`, part of the `DatasetsPlugin`: where blocks are (`Locate`, and a new rank's
`GetOrClaim` naming its host), and who reads the lazy blocks nobody holds (`OpenBlocks`;
transparent mode's `FsClaim`, `FsOpenBlocks`): one reader at a time, the first to ask (its
claim), the others waiting for its load task. A claim ends when the task arrives or its
reader's client leaves.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from distributed.comm import get_address_host

from ..arrivals import Arrivals
from ..internals import task_error
from ..protocol.scheduler import (DESCRIBE_SECONDS, HOLDERS_BLOCKS, BlocksHeld, BlocksOpened, Folders, FsClaim,
                                  FsHeld, FsMetadata,
                                  FsOpenBlocks, GetOrRegister, InfoClaims, Layouts, Located, Locate, NoWorkers,
                                  OpenBlocks, Ready)
from ..protocol.worker import WorkerAPI
from ..source.base import parse_block_key
from . import placement
from .killed import named
from .placement import RUN_NEXT

logger = logging.getLogger(__name__)


class BlockReads:
    """Used on the scheduler's event loop."""

    def __init__(self, plugin):
        self.plugin = plugin
        self.claims: dict[str, str] = {}  # block key -> the client reading it from the store
        self.waiters = Arrivals()  # `locate` calls waiting for tasks to finish
        # (dataset, worker) -> ((changes, blocks), the future of their layouts), `locate_ready`
        self.layouts: dict[tuple[str, str], tuple[tuple, asyncio.Future]] = {}

    @property
    def scheduler(self):
        return self.plugin.scheduler

    async def locate(self, request: Locate) -> Located:
        """Where the keys are once every key is held or erred, or after `timeout` seconds
        with what is known then (see `Locate`). A block of a load group (`dmdask.plan.groups`)
        is where its group's task is; a group still loading is waited for (not named as
        loading: its worker cannot wait for one block of it) and, once queued on its worker,
        told to run next there (`RUN_NEXT`, once per group and request)."""
        deadline = time.monotonic() + request.timeout
        expect, host = set(request.expect), request.host
        tasks = [self.plugin.task_key(key) for key in request.keys]
        hastened: set[str] = set()
        while True:
            hasten: dict[str, set[str]] = {}
            holders, erred, pending, unknown, loading, waited_for = {}, {}, [], [], {}, set()
            for key, task in zip(request.keys, tasks):
                ts = self.scheduler.tasks.get(task)
                if ts is None:
                    waited = key in expect or self._claimed(key) or self.plugin.unsubmitted(key)
                    (pending if waited else unknown).append(key)
                    waited_for.add(task)
                elif ts.state == "memory" and ts.who_has:
                    holders[key] = preferred_holder(ts, host)
                elif ts.state == "erred":
                    erred[key] = named(key, task_error(ts), self.scheduler, self.plugin.by_identity,
                                        self.plugin.oom_kills)
                elif request.planned and task == key and ts.state == "processing" and ts.processing_on is not None:
                    loading[key] = ts.processing_on.address
                else:
                    pending.append(key)
                    waited_for.add(task)
                    if task != key and ts.processing_on is not None and task not in hastened:
                        hasten.setdefault(ts.processing_on.address, set()).add(task)
                        hastened.add(task)
            for worker, keys in hasten.items():
                self.scheduler.worker_send(worker, {"op": RUN_NEXT, "keys": sorted(keys)})
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                return Located(holders, erred, unknown, pending, loading)
            await self.waiters.wait(waited_for, left)

    async def locate_ready(self, ready: Ready, host: str) -> Ready:
        """`ready` with the holder of each of its blocks held now, one on `host` preferred, and
        the layouts of those on `host` as their workers describe them (`Ready.holders`,
        `Ready.layouts`): the rank asking maps them with no connection to a worker of its own.
        A worker is asked once for the same blocks while none of the dataset's blocks came or
        went (`DatasetState.changes`), however many ranks of its host ask, at once or later."""
        info = ready.info
        if not ready.loaded or info.num_blocks > HOLDERS_BLOCKS:
            return ready
        holders: dict[str, list[int]] = {}
        ds = self.plugin.datasets.get(info.name)
        for k in range(info.num_blocks):
            ts = self.scheduler.tasks.get(info.block_key(k) if ds is None else ds.task_key(k))
            if ts is not None and ts.state == "memory" and ts.who_has:
                holders.setdefault(preferred_holder(ts, host), []).append(k)
        changes = None if ds is None else ds.changes
        local = [self._described(info, w, blocks, changes) for w, blocks in holders.items()
                 if get_address_host(w) == host]
        layouts = {w: layout for w, layout in await asyncio.gather(*local) if layout is not None}
        return dataclasses.replace(ready, holders=holders, layouts=layouts)

    async def _described(self, info, worker: str, blocks: list[int], changes: int | None):
        """(worker, its layouts of `blocks`, or None when it did not answer in time)."""
        state = (changes, tuple(blocks))
        entry = self.layouts.get((info.name, worker))
        if entry is None or entry[0] != state:
            entry = (state, asyncio.ensure_future(self._describe(info, worker, blocks)))
            self.layouts[(info.name, worker)] = entry
        layout = await asyncio.shield(entry[1])
        if layout is None and self.layouts.get((info.name, worker)) is entry:
            del self.layouts[(info.name, worker)]  # asked again next time
        return worker, layout

    async def _describe(self, info, worker: str, blocks: list[int]) -> Layouts | None:
        keys = [info.block_key(k) for k in blocks]
        try:
            return Layouts.of(await asyncio.wait_for(
                WorkerAPI(self.scheduler.rpc, DESCRIBE_SECONDS).describe(worker, keys), DESCRIBE_SECONDS))
        except Exception as exc:  # noqa: BLE001 - left out: the rank learns those blocks as it fetches them
            logger.debug("worker %s did not describe %d blocks of %s: %r", worker, len(keys), info.name, exc)
            return None

    def forget_layouts(self, dataset: str | None = None, worker: str | None = None) -> None:
        """Drop the layouts kept of a dataset released, or of a worker that left."""
        for name, address in list(self.layouts):
            if name == dataset or address == worker:
                del self.layouts[(name, address)]

    def open_blocks(self, request: OpenBlocks) -> BlocksOpened | NoWorkers:
        """Register the request's datasets when new, then name the holders of its keys and
        claim for its client those of lazy datasets that nobody holds, loads or reads."""
        for info in request.datasets:
            if isinstance(self.plugin.get_or_register(GetOrRegister(info)), NoWorkers):
                return NoWorkers()
        holders, mine = {}, {}
        for key in request.keys:
            ts = self.scheduler.tasks.get(key)
            parsed = parse_block_key(key)
            ds = parsed and self.plugin.by_identity.get(parsed[0])
            if ts is not None and ts.state == "memory" and ts.who_has:
                holders[key] = preferred_holder(ts, request.host)
            elif ts is None and not self._claimed(key) and ds and ds.lazy and parsed[1] < len(ds.planned):
                self.claims[key] = request.client
                mine[key] = placement.live_planned(self.scheduler, ds, parsed[1])
        return BlocksOpened(holders, mine)

    def fs_metadata(self, request: FsMetadata) -> Folders:
        files = self.plugin.files
        files.put(request.run, request.put)
        files.release(request.run, request.release)
        return Folders(files.get(request.run, request.get))

    def fs_claim(self, request: FsClaim) -> InfoClaims | NoWorkers:
        """Transparent mode's look before reading new files' infos from the store; nothing
        is claimed while the cluster has no workers (the caller waits for one)."""
        if not self.scheduler.workers:
            return NoWorkers()
        return self.plugin.files.claim(request.run, request.claim)

    def fs_open_blocks(self, request: FsOpenBlocks) -> BlocksOpened | NoWorkers:
        """After a reader read claimed files' first blocks with their infos (`FsClaim`), open
        those blocks and share the infos with the run (ending the claims) at once: a reader
        of the run that waited for an info finds its block claimed, and waits for that."""
        reply = self.open_blocks(request.open)
        self.plugin.files.put(request.run, request.put)
        return reply

    def fs_held(self, request: FsHeld) -> BlocksHeld:
        """Blocks workers placed from a reader's hand-over (`dmdask_place_blocks`), without a
        load task: each new one becomes its worker's data (Dask's `update_data`, as for scattered
        data: no task to run again, so should its worker leave, the block is forgotten and its
        next reader submits its load), wanted by its dataset, counted and its waiters woken as
        a finished load's. A block the scheduler holds elsewhere already becomes a replica; one
        it is loading elsewhere, or of no dataset, is dropped from that worker."""
        scheduler, plugin, holders = self.scheduler, self.plugin, {}
        for worker, blocks in request.held.items():
            ws, dropped = scheduler.workers.get(worker), []
            for key, nbytes in blocks.items():
                parsed = parse_block_key(key)
                ds = parsed and plugin.by_identity.get(parsed[0])
                ts = scheduler.tasks.get(key)
                if ws is None:
                    continue
                if not ds or (ts is not None and ts.state != "memory"):
                    dropped.append(key)
                    continue
                if ts is None:
                    scheduler.update_data(who_has={key: [worker]}, nbytes={key: nbytes}, client=ds.holder_client)
                    plugin.transition(key, "released", "memory")
                else:
                    scheduler.add_replica(ts, ws)
                self.claims.pop(key, None)
                holders[key] = worker
            if dropped:
                scheduler.worker_send(worker, {"op": "remove-replicas", "keys": dropped,
                                               "stimulus_id": f"dmdask-fs-held-{time.time()}"})
        return BlocksHeld(holders)

    def _claimed(self, key: str) -> bool:
        """Whether a live client is reading this block from the store."""
        return self.claims.get(key) in self.scheduler.clients

    def remove_client(self, client: str) -> None:
        """A reader left: the blocks it claimed and never handed over go to the next reader."""
        for key in [key for key, holder in self.claims.items() if holder == client]:
            del self.claims[key]
            self.waiters.wake(key)


def preferred_holder(ts, host: str | None) -> str:
    """A worker holding the task's result, one on `host` if any."""
    addresses = sorted(ws.address for ws in ts.who_has)
    local = [a for a in addresses if host and get_address_host(a) == host]
    return (local or addresses)[0]
