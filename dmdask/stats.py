"""`dmdask.stats(client)`: what every worker's tiers hold and served, and the total."""
from __future__ import annotations

import dataclasses

from distributed import Client

from .errors import NotADmdaskWorker


def _worker_stats(dask_worker) -> dict:
    metric = dask_worker.metrics.get("dmdask")  # a dmdask.Worker's tiers, with its cache's counts once started
    return None if metric is None else metric(dask_worker)


def stats(client: Client) -> dict[str, dict]:
    """Per-worker counters and their sum under "total".

    "datasets": the cluster's registry, one summary per dataset (name, url, samples,
    blocks, nbytes, loaded, erred). Each worker: {"ram"|"ssd": {capacity, bytes, blocks, hits, hit_bytes, full,
    error (why the tier's folder is unusable, None when fine), dir (the tier's folder; None: RAM in the
    worker's memory), source (where its capacity came from: a setting or the job's limits)},
    "stream": {hits, ...}, "shared_store": {requests, bytes, retries}, "peer": {bytes_out, bytes_in},
    "streamed_blocks"}. Hits count samples served from that tier; "stream" hits are
    samples of blocks beyond the cache, read from the shared store.
    """
    from .client.datasets import ensure_plugin
    from .protocol.scheduler import Datasets, SchedulerAPI

    ensure_plugin(client)  # which installs the worker plugin (the cache and its counts) on every worker
    per_worker = client.run(_worker_stats)
    missing = [w for w, s in per_worker.items() if s is None]
    if missing:
        raise NotADmdaskWorker(f"workers {missing} have no dmdask tiers; start them with --worker-class dmdask.Worker")
    registry = [dataclasses.asdict(d) for d in client.sync(SchedulerAPI(client).send, Datasets())]
    return {"workers": per_worker, "total": total(per_worker.values()), "datasets": registry}


def hit_shares(stats: dict) -> dict[str, float] | None:
    """Fractions of the samples served from RAM, SSD and streamed from the store
    (None before the first sample was served)."""
    hits = {"ram": stats["ram"]["hits"], "ssd": stats["ssd"]["hits"], "stream": stats["stream"]["hits"]}
    served = sum(hits.values())
    if not served:
        return None
    return {tier: n / served for tier, n in hits.items()}


def total(items) -> dict:
    """Sum of nested numeric counters (booleans become any(); strings, such as a tier's
    error, the distinct ones joined by "; ", None when there is none)."""
    out: dict = {}
    for item in items:
        _add(out, item)
    return out


def _add(out: dict, item: dict) -> None:
    for key, value in item.items():
        if isinstance(value, dict):
            _add(out.setdefault(key, {}), value)
        elif isinstance(value, bool):
            out[key] = out.get(key, False) or value
        elif value is None or isinstance(value, str):
            seen = out.get(key)
            if value and (seen is None or value not in seen.split("; ")):
                out[key] = value if seen is None else f"{seen}; {value}"
            else:
                out[key] = seen
        else:
            out[key] = out.get(key, 0) + value
