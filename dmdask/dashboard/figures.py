"""The numbers behind the dmdask dashboard, read on the scheduler without asking any worker:
each worker's `BlockCache.stats()` from its heartbeat metrics (up to one heartbeat old) and
the registry of dmdask's scheduler plugin. `snapshot(scheduler)` is the one dict that the
page, `/dmdask/tiers.json` and Prometheus show; its "workers" and "total" have the shape of
`dmdask.stats(client)`.
"""
from __future__ import annotations

import time
import weakref
from collections import deque

from ..protocol.metric import empty_metric, metric_of
from ..stats import hit_shares
from ..stats import total as sum_stats

HISTORY_SECONDS = 3600  # what the line plot can show
SAMPLE_INTERVAL = 1.0  # seconds between two history points


def empty_stats() -> dict:
    """A worker's stats with every counter at zero (the shape of `BlockCache.stats()`, as
    `dmdask.protocol.metric` declares it)."""
    return empty_metric()


def worker_metrics(scheduler):
    """{address: stats} of the workers that report dmdask metrics, their names, and the
    addresses of the workers that do not (plain Dask workers, or not heartbeated yet)."""
    workers, names, others = {}, {}, []
    for address, ws in list(scheduler.workers.items()):
        metrics = metric_of(ws)
        if metrics is not None:
            workers[address] = metrics
            names[address] = str(ws.name)
        else:
            others.append(address)
    return dict(sorted(workers.items())), names, sorted(others)


def datasets(scheduler) -> dict[str, dict]:
    """The datasets in dmdask's registry, grouped as `dmdask status` groups them (one entry
    per folder of the files read in transparent mode: `dmdask.stats.dataset_rows`): the
    source URL (without credentials), blocks, blocks loaded (cached in a tier or streamed),
    samples and decoded bytes (None when unknown), and a folder's number of files."""
    import dataclasses

    from ..stats import dataset_rows

    plugin = scheduler.extensions.get("dmdask")
    summaries = [dataclasses.asdict(d) for d in plugin.summaries()] if plugin is not None else []
    out = {}
    for d in dataset_rows(summaries):
        out[d["name"]] = {"url": d["url"], "blocks": d["blocks"], "loaded_blocks": d["loaded"],
                          "samples": d["samples"], "bytes": d["nbytes"]}
        if d["files"] is not None:
            out[d["name"]]["files"] = d["files"]
    return dict(sorted(out.items()))


def dataset_sizes(scheduler) -> dict[str, dict]:
    """`datasets` less what the history needs not (URLs, counts of loaded blocks): a dataset's
    blocks and bytes, read from the registry as it is. Cheap at any number of datasets
    (transparent mode registers one per file), so the once-a-second history costs the
    scheduler's event loop next to nothing."""
    plugin = scheduler.extensions.get("dmdask")
    return {name: {"blocks": len(ds.planned), "bytes": ds.info.nbytes if ds.info else None}
            for name, ds in list(plugin.datasets.items())} if plugin is not None else {}


def cluster_summary(total: dict, sets: dict[str, dict], workers: int | None = None) -> dict:
    """Whole-cluster figures: how much of the registered datasets the tiers hold and
    what was read from the shared store so far."""
    cached_bytes = total["ram"]["bytes"] + total["ssd"]["bytes"]
    cached_blocks = total["ram"]["blocks"] + total["ssd"]["blocks"]
    dataset_blocks = sum(d["blocks"] for d in sets.values())
    sizes = [d["bytes"] for d in sets.values()]
    dataset_bytes = sum(sizes) if sets and None not in sizes else None
    return {
        "workers": workers,
        "datasets": len(sets),
        "dataset_blocks": dataset_blocks,
        "dataset_bytes": dataset_bytes,
        "cached_blocks": cached_blocks,
        "cached_bytes": cached_bytes,
        "streamed_blocks": total["streamed_blocks"],
        # blocks, not bytes: exact for every kind of source (decoded sizes from
        # metadata are estimates for folders of files)
        "cached_share": min(1.0, cached_blocks / dataset_blocks) if dataset_blocks else None,
        "shared_store_bytes": total["shared_store"]["bytes"],
        "shared_store_requests": total["shared_store"]["requests"],
        "shared_store_reads_per_dataset": (total["shared_store"]["bytes"] / dataset_bytes
                                           if dataset_bytes else None),
        "peer_bytes": total["peer"]["bytes_in"],  # received by workers from other workers
        "peer_bytes_out": total["peer"]["bytes_out"],  # sent by workers: to other workers and to ranks
        "hit_shares": hit_shares(total),
    }


def snapshot(scheduler) -> dict:
    """Everything the page, the JSON route and Prometheus show, as plain JSON types."""
    workers, names, others = worker_metrics(scheduler)
    return _snapshot(workers, names, others, datasets(scheduler))


def snapshot_of_nothing() -> dict:
    return _snapshot({}, {}, [], {})


def _snapshot(workers: dict, names: dict, others: list, sets: dict) -> dict:
    total = sum_stats(workers.values()) if workers else empty_stats()
    return {
        "time": time.time(),
        "workers": workers,
        "total": total,
        "names": names,
        "hit_shares": {address: hit_shares(s) for address, s in workers.items()},
        "other_workers": others,
        "datasets": sets,
        "cluster": cluster_summary(total, sets, workers=len(workers)),
    }


class Monitor:
    """One per scheduler: a short-lived cache of the snapshot and a history of the
    cluster totals (one point a second, the last hour) for the line plot."""

    def __init__(self, scheduler):
        self._scheduler = weakref.ref(scheduler)
        self.history: deque = deque(maxlen=int(HISTORY_SECONDS / SAMPLE_INTERVAL))
        self._latest: dict | None = None
        self._callback = None

    @property
    def scheduler(self):
        return self._scheduler()

    def snapshot(self, max_age: float = 0.25) -> dict:
        latest = self._latest
        if latest is None or time.time() - latest["time"] > max_age:
            scheduler = self.scheduler
            if scheduler is None:
                return latest or snapshot_of_nothing()
            latest = self._latest = snapshot(scheduler)
        return latest

    def sample(self) -> None:
        """Add one history point (cheap: counters kept by the scheduler plugin)."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        workers = worker_metrics(scheduler)[0]
        total = sum_stats(workers.values()) if workers else empty_stats()
        cluster = cluster_summary(total, dataset_sizes(scheduler), workers=len(workers))
        self.history.append({
            "time": time.time(),
            "shared_store_bytes": total["shared_store"]["bytes"],
            "shared_store_requests": total["shared_store"]["requests"],
            "dataset_bytes": cluster["dataset_bytes"],
            "cached_bytes": cluster["cached_bytes"],
            "ram_hits": total["ram"]["hits"],
            "ssd_hits": total["ssd"]["hits"],
            "stream_hits": total["stream"]["hits"],
            "peer_bytes": cluster["peer_bytes"],
            "peer_bytes_out": cluster["peer_bytes_out"],
        })

    def start(self) -> None:
        """Sample every second on the scheduler's event loop (stopped with the scheduler)."""
        scheduler = self.scheduler
        if self._callback is not None or scheduler is None:
            return
        from tornado.ioloop import PeriodicCallback

        self.sample()
        self._callback = PeriodicCallback(self.sample, SAMPLE_INTERVAL * 1000)
        scheduler.periodic_callbacks["dmdask-dashboard"] = self._callback  # Server.close stops it
        self._callback.start()

    def stop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None


_monitors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def monitor(scheduler) -> Monitor:
    """The scheduler's `Monitor`, created on first use."""
    found = _monitors.get(scheduler)
    if found is None:
        found = _monitors[scheduler] = Monitor(scheduler)
    return found
