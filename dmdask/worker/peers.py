"""`ClusterWorkers`: which addresses are workers of this worker's cluster, as its scheduler
says. A rank's batch request names the holders a worker gathers rows from; a worker dials
only those (a client cannot make it connect to any address it names)."""
from __future__ import annotations

from collections.abc import Iterable

from ..protocol.scheduler import SchedulerAPI, Workers

KNOWN_MOST = 65_536  # addresses remembered (then forgotten all at once and asked again)


class ClusterWorkers:
    """Addresses the scheduler named as its workers are remembered; any other is asked of
    the scheduler (one request for all of a batch's), from the worker's event loop."""

    def __init__(self, worker):
        self.api = SchedulerAPI(worker)  # the worker's `scheduler` rpc
        self.known: set[str] = set()

    async def strangers(self, addresses: Iterable[str]) -> list[str]:
        """Those of `addresses` that are not workers of the cluster now (nor known to have been)."""
        unknown = sorted(set(addresses) - self.known)
        if not unknown:
            return []
        if len(self.known) > KNOWN_MOST:
            self.known.clear()
        self.known.update(await self.api.send(Workers(unknown)))
        return [a for a in unknown if a not in self.known]
