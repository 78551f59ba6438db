"""A rank's contact with its cluster: whether the scheduler answers, which workers there
are, and the worker on the rank's own node that serves it (rank r: local worker r mod n).
Its guarantees on a lost scheduler or no workers: docs/architecture.md section 2.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import warnings
import weakref

import dask.config
from distributed.comm import get_address_host
from distributed.comm.core import CommClosedError

from ..errors import SchedulerLostError, no_workers, waiting_for_workers
from ..protocol.worker import connect_within
from ..recovery import Tries
from .gather import CONNECT_SECONDS
from .locate import my_host

logger = logging.getLogger(__name__)
_reached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> scheduler its workers were reached on
CONNECT_AHEAD = 32  # workers a cold iterator connects to ahead of its first requests


async def connect_ahead(client, address: str) -> None:
    """A connection to `address` made now for the client's pool; never raises (the next call would)."""
    try:
        comm = await connect_within(client.rpc, address, CONNECT_SECONDS)
    except Exception:  # noqa: BLE001 - best effort
        return
    client.rpc.reuse(address, comm)


class Contact:
    """One iterator's view of its client's cluster; coroutines of the client's loop."""

    def __init__(self, client, rank: int, who: str | None = None):
        self.client, self.rank = client, rank
        self.who = who or f"rank {rank}"  # named in its errors
        self.worker: str | None = None  # this rank's local worker, once chosen
        self._said_waiting = False  # the wait for workers was logged

    def reach_ahead(self, loop) -> None:
        """Once per client and scheduler, in the background: `reach_workers`."""
        if self.client.scheduler is not None and _reached.get(self.client) != self.client.scheduler.address:
            _reached[self.client] = self.client.scheduler.address
            asyncio.run_coroutine_threadsafe(self.reach_workers(), loop)

    async def reach_workers(self) -> None:
        """Best effort, ahead of a cold iterator's first requests: the local worker chosen,
        connections made (this host's first)."""
        workers = await self.workers(wait=False)
        if workers:
            self._choose_local_worker(workers)
        mine = my_host(self.client)
        nearest = sorted(workers, key=lambda w: get_address_host(w) != mine)[:CONNECT_AHEAD]
        await asyncio.gather(*(connect_ahead(self.client, w) for w in nearest))

    async def check_scheduler(self) -> None:
        """Wait while the client reconnects to its scheduler (or `SchedulerLostError`)."""
        limit = float(dask.config.get("dmdask.client.scheduler-seconds"))
        async for _ in Tries(limit, pause=0.2):
            if self.client.status == "running" and self.client.scheduler is not None:
                return
            if self.client.status in ("closing", "closed"):
                break
        raise self._scheduler_lost(f"status {self.client.status!r}", limit)

    def _scheduler_lost(self, how: str, limit: float) -> SchedulerLostError:
        return SchedulerLostError(
            f"{self.who} lost the scheduler of its client ({how} for {limit:.0f} s, "
            "dmdask.client.scheduler-seconds): resume from the last state_dict() once a scheduler runs again")

    async def identity(self) -> dict:
        """The scheduler's identity, asked again while it does not answer."""
        limit = float(dask.config.get("dmdask.client.scheduler-seconds"))
        tries = Tries(limit, pause=0.2)
        async for _ in tries:
            await self.check_scheduler()
            with contextlib.suppress(OSError, CommClosedError):  # TimeoutError is an OSError
                return await asyncio.wait_for(self.client.scheduler.identity(), max(0.5, tries.deadline.left()))
        raise self._scheduler_lost("no answer", limit)

    async def workers(self, wait: bool = True) -> list[str]:
        """The cluster's workers, waited for while none (or `NoWorkersError`); wait=False: maybe none."""
        limit = float(dask.config.get("dmdask.client.recovery-seconds"))
        async for _ in Tries(limit, pause=0.5):
            workers = sorted((await self.identity())["workers"])
            if workers:
                self._said_waiting = False
            if workers or not wait:
                return workers
            if not self._said_waiting:
                self._said_waiting = True
                logger.warning(waiting_for_workers(limit))
        raise no_workers(limit)

    async def wait_if_no_workers(self) -> bool:
        """If the cluster has no workers: the local worker forgotten, `workers()` awaited, True."""
        if await self.workers(wait=False):
            return False
        self.forget_worker()
        await self.workers()
        return True

    async def local_worker(self) -> str:
        if self.worker is None:
            self._choose_local_worker(await self.workers())
        return self.worker

    def forget_worker(self) -> None:
        """The local worker left: the next `local_worker` chooses again."""
        self.worker = None

    def _choose_local_worker(self, workers: list[str]) -> None:
        if self.worker is not None:  # chosen meanwhile (`reach_workers` and `local_worker` may both ask)
            return
        mine = my_host(self.client)
        local = [w for w in workers if get_address_host(w) == mine]
        if not local:
            warnings.warn(f"no dmdask worker on this node ({mine}); batches will cross the network",
                          RuntimeWarning, stacklevel=2)
            local = workers
        self.worker = local[self.rank % len(local)]
