"""How workers left: on purpose (`Departures`, for a rank whose request a closing worker
dropped), or killed. A block whose load killed its workers (Dask's `KilledWorker`) named as a dmdask error:
`WorkerKilledError`, with the likely cause (out of memory) and the evidence the workers
report in their heartbeats (the out-of-memory kills their memory cgroup counted, their
RAM tier and where its size came from)."""
from __future__ import annotations

from dask.utils import format_bytes
from distributed import KilledWorker

from ..errors import WorkerKilledError, redact
from ..internals import reraise
from ..protocol.metric import metric_of
from ..source.base import parse_block_key


KEPT = 1024  # workers whose out-of-memory kills are remembered


class OomKills:
    """The out-of-memory kills each worker's memory cgroup had counted when it was last seen
    starting a block's load (from its heartbeat metrics): a worker is gone from the scheduler
    by the time its death fails the block, so the evidence is taken before."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def seen(self, ws) -> None:
        metrics = metric_of(ws)
        count = metrics.get("oom_kills", 0) if metrics is not None else 0
        if count:
            if len(self.counts) >= KEPT:
                self.counts.pop(next(iter(self.counts)))
            self.counts[ws.address] = count

    def of(self, scheduler) -> dict[str, int]:
        """address -> kills, of the workers present and of those seen before."""
        found = dict(self.counts)
        for ws in scheduler.workers.values():
            metrics = metric_of(ws)
            if metrics is not None and metrics.get("oom_kills", 0):
                found[ws.address] = metrics["oom_kills"]
        return found


class Departures:
    """The workers that said they were closing (their status changed to closing, as a worker
    closed by its nanny, a scale-down or `retire_workers` does) or that the scheduler removed
    as expected: they left on purpose. The last `KEPT` are remembered; a worker that joins
    again at the same address is forgotten."""

    LEAVING = frozenset({"closing", "closing_gracefully", "closed"})

    def __init__(self):
        self.on_purpose: dict[str, None] = {}  # address -> None, oldest first

    def event(self, topic: str, msg) -> None:
        """A scheduler event (`SchedulerPlugin.log_event`)."""
        if not isinstance(msg, dict):
            return
        if msg.get("action") == "worker-status-change" and msg.get("status") == "running":
            self.joined(topic)  # a retirement given up
            return
        leaving = msg.get("action") == "worker-status-change" and msg.get("status") in self.LEAVING
        if leaving or (msg.get("action") == "remove-worker" and msg.get("expected") is True):
            address = msg.get("worker", topic)
            self.on_purpose.pop(address, None)
            if len(self.on_purpose) >= KEPT:
                self.on_purpose.pop(next(iter(self.on_purpose)))
            self.on_purpose[address] = None

    def joined(self, address: str) -> None:
        self.on_purpose.pop(address, None)

    def left_on_purpose(self, address: str) -> bool:
        return address in self.on_purpose


def named(key: str, error, scheduler, by_identity: dict, kills: OomKills):
    """`error` (a failed block's, as the scheduler keeps it) as it is, unless it is a
    `KilledWorker`: then a `WorkerKilledError` naming the block and the cause."""
    try:
        raised = reraise(error)
    except Exception:  # noqa: BLE001 - an error that does not unpickle here is passed on as it is
        return error
    if not isinstance(raised, KilledWorker):
        return error
    parsed = parse_block_key(key)
    ds = parsed and by_identity.get(parsed[0])
    what = f"block {key}"
    if ds and ds.info is not None:
        start, stop = ds.info.block_range(parsed[1])
        what = f"block {parsed[1]} (samples {start}..{stop - 1}) of {redact(ds.info.url)}"
    metrics = {ws.address: metric_of(ws) for ws in scheduler.workers.values()}
    metrics = {a: m for a, m in metrics.items() if m is not None}
    killed = kills.of(scheduler)
    if killed:
        cause = "out of memory: " + "; ".join(f"the memory cgroup of worker {a} counted {n} out-of-memory "
                                              f"kill{'s' if n > 1 else ''}" for a, n in sorted(killed.items()))
    else:
        cause = ("most likely out of memory (a worker killed while it loads a block is most often killed by the "
                 "kernel's out-of-memory killer: its nanny logs 'killed by signal 9')")
    ram = next((m["ram"] for m in metrics.values()), None)
    tier = "" if ram is None else (f"; each worker's RAM tier is {format_bytes(ram.get('capacity', 0))} "
                                   f"({ram.get('source')})")
    return WorkerKilledError(f"{what}: the workers that loaded it died while loading it (Dask's KilledWorker: "
                             f"{raised}); {cause}{tier}. Give the workers more memory, or set a smaller "
                             "dmdask.worker.ram or block_size")
