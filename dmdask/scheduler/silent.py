"""`SilentWorkers`, part of the `DatasetsPlugin`: a worker that sends its scheduler no
heartbeat for `dmdask.worker.silent-seconds` while the others do (a paused process, a hung
or frozen node) is treated as lost, as Dask treats one after `distributed.scheduler.worker-ttl` (5 minutes by
default): restarted by its nanny, else removed. Its blocks are then planned anew over the
workers present (`DatasetsPlugin.remove_worker`), so the rows it owed (held or still
loading) are read from the store by the others, and the ranks that waited on it ask them
of their new holders (a rank's reply waits at most half `dmdask.client.recovery-seconds`).

Guarantees: a worker is never treated so while it heartbeats (a slow reply to a rank is
not silence), nor before ten of Dask's heartbeat intervals (5 s on clusters of up to 10
workers, as `worker-ttl`'s own floor); silence is measured against the other workers'
latest heartbeat, so workers late alike (a stalled scheduler, a machine out of CPU) are
never treated so, nor the last worker (the others must be there to read its blocks); each
silent worker is restarted or removed once; a worker that resumes afterwards is not one
of the cluster's any more (its cache was read again by the others). `silent-seconds: 0`
leaves it to Dask's `worker-ttl`.
"""
from __future__ import annotations

import asyncio
import logging

import dask.config
from distributed.metrics import time
from distributed.scheduler import heartbeat_interval
from tornado.ioloop import PeriodicCallback

logger = logging.getLogger(__name__)
CHECK_SECONDS = 1.0  # how often the workers' last heartbeats are looked at


def silent_seconds() -> float:
    return float(dask.config.get("dmdask.worker.silent-seconds"))


class SilentWorkers:
    """Used on the scheduler's event loop; `start` once the scheduler is known."""

    def __init__(self):
        self.scheduler = None
        self.handled: set[str] = set()  # addresses being restarted or removed (never twice)
        self._restarts: set[asyncio.Task] = set()

    def start(self, scheduler) -> None:
        """Look at the workers' heartbeats every `CHECK_SECONDS` (stopped with the scheduler,
        which stops its `periodic_callbacks`), unless `silent-seconds` is 0."""
        self.scheduler = scheduler
        if silent_seconds() > 0 and "dmdask-silent-workers" not in scheduler.periodic_callbacks:
            callback = PeriodicCallback(self.check, CHECK_SECONDS * 1000)
            scheduler.periodic_callbacks["dmdask-silent-workers"] = callback
            callback.start()

    def silent(self) -> dict[str, float]:
        """Address -> seconds its last heartbeat is older than the latest worker's, of the
        workers that far behind for longer than `silent-seconds` (and ten heartbeat intervals).
        Measured against the other workers, not the clock: when every worker is late alike (the
        scheduler's own event loop stalled, a machine out of CPU), none is silent."""
        workers = self.scheduler.workers
        if len(workers) < 2:
            return {}
        bound = max(silent_seconds(), 10 * heartbeat_interval(len(workers)))
        latest = max(ws.last_seen for ws in workers.values())
        return {address: latest - ws.last_seen for address, ws in workers.items()
                if latest - ws.last_seen > bound and address not in self.handled}

    def left(self, address: str) -> None:
        """A worker left the scheduler (an address may come back: a worker restarted on a fixed port)."""
        self.handled.discard(address)

    def check(self) -> None:
        silent = self.silent()
        if not silent:
            return
        self.handled.update(silent)
        for address, seconds in silent.items():
            logger.warning("worker %s sent no heartbeat for %.0f s while the others did (dmdask.worker.silent-seconds"
                           "=%g): a paused "
                           "or hung worker, treated as lost (restarted by its nanny, else removed); its blocks are "
                           "read again by the others", address, seconds, silent_seconds())
        self.scheduler.log_event("dmdask", {"action": "silent-workers", "workers": sorted(silent),
                                            "silent-seconds": silent_seconds()})
        task = asyncio.ensure_future(self._restart(list(silent)))  # a nanny's kill takes seconds: not waited for
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, addresses: list[str]) -> None:
        try:
            await self.scheduler.restart_workers(addresses, wait_for_workers=False, on_error="return",
                                                 stimulus_id=f"dmdask-silent-workers-{time()}")
        except Exception:  # noqa: BLE001 - logged; Dask's worker-ttl still applies
            logger.exception("restarting the silent workers %s failed", addresses)
