"""`dmdask.stats(client)`: what every worker's tiers hold and served, and the total."""
from __future__ import annotations

import dataclasses
import posixpath

from distributed import Client

from .errors import NotADmdaskWorker


def _worker_stats(dask_worker) -> dict:
    metric = dask_worker.metrics.get("dmdask")  # a dmdask.Worker's tiers, with its cache's counts once started
    return None if metric is None else metric(dask_worker)


def stats(client: Client) -> dict[str, dict]:
    """{"workers": {address: counters}, "total": their sum, "datasets": the registry}: each
    counter is described in docs/architecture.md, section 9 ("Accounting"); the hits count
    every batch this process has handed out. Raises NotADmdaskWorker when a worker has no
    dmdask tiers."""
    from .client.datasets import ensure_plugin
    from .client.gather import wait_reported
    from .protocol.scheduler import Datasets, SchedulerAPI

    wait_reported(client)  # an epoch's last hits are sent as it ends, not waited for
    ensure_plugin(client)  # which installs the worker plugin (the cache and its counts) on every worker
    per_worker = client.run(_worker_stats)
    missing = [w for w, s in per_worker.items() if s is None]
    if missing:
        raise NotADmdaskWorker(f"workers {missing} have no dmdask tiers; start them with --worker-class dmdask.Worker")
    registry = [dataclasses.asdict(d) for d in client.sync(SchedulerAPI(client).send, Datasets())]
    return {"workers": per_worker, "total": total(per_worker.values()), "datasets": registry}


def dataset_rows(datasets) -> list[dict]:
    """The registry (`DatasetSummary` dicts) as `dmdask status` and the dashboard show it: one
    row per dataset, then one per folder of the files read in transparent mode (`dmdask::`,
    each file a dataset of its own, named fs-...), its files' counts summed, folders sorted.
    URLs without credentials. Each row: name, url, samples, blocks, loaded, erred, nbytes
    (None when one of its datasets' is unknown), and `files`/`folder` (None for a dataset;
    a folder's row is named `dmdask::FOLDER/`)."""
    from .source.urls import public

    rows, folders = [], {}
    for d in datasets:
        if str(d["name"]).startswith("fs-") and d.get("url"):  # one file of transparent mode
            folder = posixpath.dirname(public(str(d["url"])))
            row = folders.setdefault(folder, {"name": f"dmdask::{folder}/", "url": f"{folder}/", "samples": 0,
                                              "blocks": 0, "loaded": 0, "erred": 0, "nbytes": 0, "files": 0,
                                              "folder": folder})
            for key in ("samples", "blocks", "loaded", "erred"):
                row[key] += d.get(key) or 0
            row["nbytes"] = None if row["nbytes"] is None or d.get("nbytes") is None else row["nbytes"] + d["nbytes"]
            row["files"] += 1
            continue
        rows.append({"name": d["name"], "url": public(str(d["url"])) if d.get("url") else None,
                     "samples": d.get("samples"), "blocks": d["blocks"], "loaded": d["loaded"],
                     "erred": d.get("erred", 0), "nbytes": d.get("nbytes"), "files": None, "folder": None})
    return rows + [folders[f] for f in sorted(folders)]


def hit_shares(stats: dict) -> dict[str, float] | None:
    """Fractions of the samples served from RAM, SSD and the store (None before the first)."""
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
