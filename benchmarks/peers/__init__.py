"""Scenario 8: dmdask beside the loaders users pick today, on the same work.

One dataset of image-like samples (16-110 KB), written once in each loader's own format
(conversion timed apart), on one throttled, counting store: `StoreServer` for HTTP
readers, moto's S3 server behind the same throttle and counters for the S3-only ones.
Each loader runs at each point (simulated nodes, node cache) with the same ranks (one
process each, a gloo process group as torchrun makes), the same loader processes per rank,
the same emulated step and the same cores, one loader at a time. A loader-bound point
(`"rate": 0`) has no emulated step, so that every loader is the bottleneck; with
`"same_host": True` dmdask runs there once more with all the point's ranks on one node whose
worker holds the whole cluster's cache (the same-host path: every row mapped, none over
TCP), the figure its remote per-rank samples/s are shown against. Per loader and epoch:
wall time, stall, samples/s, store bytes and requests, node-local bytes written, the peak
memory of every process, duplicates and misses. See `runner`, `rank`, and one module per
loader (`torch_dataloader`, `webdataset_peer`, `mosaic`, `litdata_peer`, `grain_peer`,
`dmdask_peer`, `transparent`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings

from ..common import workdir
from ..store_server import StoreProcess
from . import dataset, dmdask_peer, grain_peer, litdata_peer, mosaic, torch_dataloader, transparent, webdataset_peer
from .goals import goals
from .report import report  # noqa: F401 - the scenario's report(result, plots_dir)
from .runner import run_one

LOADERS = [torch_dataloader, webdataset_peer, mosaic, litdata_peer, grain_peer, dmdask_peer, transparent]
MIB = 2**20
# samples: the dataset (mean 63 KB a sample). points: simulated nodes and the cache of each
# node as a fraction of the dataset. rate: the emulated step, samples/s per rank. latency (s
# a request) and bandwidth (bytes/s, all clients together): the store. block: files per dmdask
# block. shard_bytes: WebDataset, Mosaic and LitData shards. timeout: seconds for one run.
# A point's own "rate" replaces the preset's (0: no emulated step, the loader-bound points), and
# its own "epochs" the preset's (more warm epochs where each is short, for a steadier mean);
# "same_host": dmdask once more with the point's ranks all on one node (`same_host_run`).
PRESETS = {
    "tiny": {"samples": 96, "epochs": 2, "ranks_per_node": 1, "loader_workers": 1, "batch": 16, "block": 16,
             "rate": 4000, "latency": 0.001, "bandwidth": 64 * MIB, "shard_bytes": MIB, "timeout": 240,
             "points": [{"nodes": 2, "node_cache": 0.6},
                        {"nodes": 2, "node_cache": 0.6, "rate": 0, "epochs": 3, "same_host": True}]},
    "quick": {"samples": 1024, "epochs": 3, "ranks_per_node": 2, "loader_workers": 1, "batch": 32, "block": 32,
              "rate": 256, "latency": 0.002, "bandwidth": 32 * MIB, "shard_bytes": 2 * MIB, "timeout": 300,
              "points": [{"nodes": 2, "node_cache": 0.6}, {"nodes": 4, "node_cache": 0.35},
                         {"nodes": 2, "node_cache": 0.3},
                         {"nodes": 2, "node_cache": 0.6, "rate": 0, "epochs": 6, "same_host": True},
                         {"nodes": 4, "node_cache": 0.35, "rate": 0, "epochs": 6, "same_host": True}]},
    "full": {"samples": 4096, "epochs": 4, "ranks_per_node": 2, "loader_workers": 1, "batch": 32, "block": 64,
             "rate": 512, "latency": 0.002, "bandwidth": 48 * MIB, "shard_bytes": 4 * MIB, "timeout": 600,
             "points": [{"nodes": 2, "node_cache": 0.6}, {"nodes": 4, "node_cache": 0.35},
                        {"nodes": 2, "node_cache": 0.3}, {"nodes": 4, "node_cache": 0.15},
                        {"nodes": 2, "node_cache": 0.6, "rate": 0, "epochs": 8, "same_host": True},
                        {"nodes": 4, "node_cache": 0.35, "rate": 0, "epochs": 8, "same_host": True}]},
}
SEED = 0


@contextlib.contextmanager
def _s3(cfg: dict):
    """moto's S3 server behind the store's throttle, in a process of its own, or the reason it cannot run."""
    try:
        import moto.server  # noqa: F401 - what the server process runs

        store = StoreProcess("benchmarks.peers.s3:main", *_throttle(cfg)).start()
    except Exception as exc:  # noqa: BLE001 - no moto here: the S3 peers say why
        yield f"no S3 server: {type(exc).__name__}: {exc} (`moto[server]`, installed by make bench-peers)"
        return
    try:
        yield store
    finally:
        store.stop()


def run(preset: str) -> dict:
    cfg = PRESETS[preset]
    warnings.filterwarnings("ignore")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    started = time.perf_counter()
    n = cfg["samples"]
    with workdir("peers") as root:
        data = os.path.join(root, "data")
        formats = {}
        for fmt in ("files", "tar", "mds", "litdata"):
            needed = [m for m in LOADERS if m.FORMAT == fmt]
            reasons = [m.available() for m in needed]
            formats[fmt] = (dataset.convert(fmt, data, n, cfg["shard_bytes"], SEED)
                            if None in reasons or fmt == "files"  # files: D, and dmdask's own format
                            else {"error": "no loader of this format can run here"})
        size = formats["files"]["bytes"]
        points = []
        # each store in a process of its own (`StoreProcess`): nothing this process does slows it
        with StoreProcess("benchmarks.store_server:main", data, *_throttle(cfg)) as http, _s3(cfg) as s3:
            for fmt in ("mds", "litdata"):
                if not isinstance(s3, str) and "error" not in formats[fmt]:
                    from .s3 import upload

                    t = time.perf_counter()
                    upload(s3.info["moto"], os.path.join(data, fmt), fmt)
                    formats[fmt]["upload_s"] = time.perf_counter() - t
            ctx = _context(cfg, data, http, s3)
            for p in cfg["points"]:
                point = dict(p, rate=p.get("rate", cfg["rate"]), epochs=p.get("epochs", cfg["epochs"]),
                             node_cache_bytes=int(p["node_cache"] * size),
                             loaders={})
                points.append(point)
                tag = f"{p['nodes']} nodes, {p['node_cache']:.2f} D a node" + ("" if point["rate"] else ", no step")
                for module in LOADERS:
                    point["loaders"][module.NAME] = r = _one(module, point, ctx, formats, http, s3, cfg)
                    print(f"[peers] {tag}, {module.NAME}: {_brief(r)}", flush=True)
                if p.get("same_host"):
                    point["same_host"] = r = same_host_run(point, ctx, http, cfg)
                    print(f"[peers] {tag}, dmdask with all ranks on one node: {_brief(r)}", flush=True)
    result = {"config": cfg, "dataset_bytes": size, "formats": formats, "points": points,
              "loaders": [{"name": m.NAME, "label": m.LABEL, "format": m.FORMAT, "store": m.STORE, "can": m.CAN,
                           "settings": m.settings(cfg)} for m in LOADERS],
              "runtime_s": time.perf_counter() - started}
    result["goals"] = goals(result)
    return result


def same_host_run(point: dict, ctx: dict, http, cfg: dict) -> dict:
    """dmdask with `point`'s ranks all on one node, whose one worker's RAM tier is the cluster's
    cache (every node's together): the same ranks, epochs and store, each row mapped from that
    node's arenas, none over TCP. Its "nodes" is 1; "ranks" the point's rank count."""
    ranks = point["nodes"] * ctx["ranks_per_node"]
    one = {"nodes": 1, "node_cache": point["nodes"] * point["node_cache"], "rate": point["rate"],
           "epochs": point["epochs"], "node_cache_bytes": point["nodes"] * point["node_cache_bytes"]}
    r = run_one(dmdask_peer, one, dict(ctx, ranks_per_node=ranks, rate=point["rate"], epochs=point["epochs"]), http,
                {}, cfg["timeout"])
    return dict(r, nodes=1, ranks=ranks)


def _throttle(cfg: dict) -> list:
    return ["--latency", str(cfg["latency"]), "--bandwidth", str(int(cfg["bandwidth"]))]


def _brief(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}"
    return (f"epoch 1 {r['epoch1_s']:.1f} s, later {r['later_s']:.1f} s, store {r['store_bytes'] / MIB:.0f} MiB, "
            f"exactly once {r['exactly_once']}")


def _context(cfg: dict, data: str, http, s3) -> dict:
    files = sorted(os.path.relpath(os.path.join(d, f), data) for d, _, fs in os.walk(os.path.join(data, "files"))
                   for f in fs)
    tars = sorted(f"tar/{f}" for f in os.listdir(os.path.join(data, "tar"))) if os.path.isdir(data + "/tar") else []
    return {"samples": cfg["samples"], "epochs": cfg["epochs"], "ranks_per_node": cfg["ranks_per_node"],
            "loader_workers": cfg["loader_workers"], "batch": cfg["batch"], "block": cfg["block"], "seed": SEED,
            "rate": cfg["rate"], "min_cache_bytes": 4 * cfg["shard_bytes"],
            "file_urls": [f"{http.url}/{f}" for f in files], "tar_urls": [f"{http.url}/{t}" for t in tars],
            "s3_url": None if isinstance(s3, str) else s3.url}


def _one(module, point: dict, ctx: dict, formats: dict, http, s3, cfg: dict) -> dict:
    reason = module.available()
    if reason is None and "error" in formats[module.FORMAT]:
        reason = f"converting to {module.FORMAT} failed: {formats[module.FORMAT]['error']}"
    if reason is None and module.STORE == "s3" and isinstance(s3, str):
        reason = s3
    if reason is not None:
        return {"status": "not run", "reason": reason}
    store = http if module.STORE == "http" else s3
    env = {} if module.STORE == "http" else _s3_env(s3)
    return run_one(module, point, dict(ctx, rate=point["rate"], epochs=point["epochs"]), store, env, cfg["timeout"])


def _s3_env(store) -> dict:
    from .s3 import environment

    return environment(store)
