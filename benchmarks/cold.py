"""Scenario 10: first contact. Epoch 1 with a training step in rank processes, and a new
process on a warm cache.

Part 1 (cold): a folder of per-sample files on a throttled `StoreServer`; `world` rank
processes start together and each runs `epochs` epochs of an emulated training step (a
sleep of batch_size / rate after each batch). Baseline: per rank, PyTorch's
DataLoader(num_workers, persistent_workers) + DistributedSampler reading the store.
dmdask: `dmdask.batches` on a fresh 2-worker `LocalCluster` whose RAM holds the dataset
(cold at the start). Recorded: every GET's start and end on the store and every batch's
arrival in every rank (wall clock), so the report shows both loaders' timelines.

Part 2 (warm cache, new process): a Zarr dataset of small samples is loaded into the
cluster's RAM by one process, which exits; then 1, and then 2, new rank processes each
run two epochs with no compute. Their first epoch pays what a new job pays on a warm
cache (opening the dataset, learning where blocks are, mapping the arenas); the goal is
that it costs little more than their second.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import time
from typing import Dict, List

import numpy as np

from .common import dataset_bytes, dmdask_cluster, ratio, served_bytes, workdir, write_files

PRESETS = {
    "tiny": {"samples": 512, "sample_bytes": 4096, "batch": 32, "world": 2, "epochs": 2, "rate": 4000,
             "latency": 0.001, "bandwidth": 2 * 2**20, "block": 32, "loader_workers": 2,
             "warm": {"samples": [4000], "sample_bytes": 3072, "chunk": 100, "batch": 64, "ranks": [1, 2], "repeats": 2}},
    "quick": {"samples": 3072, "sample_bytes": 16384, "batch": 32, "world": 2, "epochs": 2, "rate": 1000,
              "latency": 0.002, "bandwidth": 16 * 2**20, "block": 64, "loader_workers": 2,
              "warm": {"samples": [40000, 160000], "sample_bytes": 3072, "chunk": 500, "batch": 256, "ranks": [1, 2], "repeats": 5}},
    "full": {"samples": 8192, "sample_bytes": 16384, "batch": 64, "world": 2, "epochs": 2, "rate": 1500,
             "latency": 0.002, "bandwidth": 24 * 2**20, "block": 128, "loader_workers": 2,
             "warm": {"samples": [40000, 200000], "sample_bytes": 3072, "chunk": 1000, "batch": 256, "ranks": [1, 2], "repeats": 5}},
}
SEED = 0
GRID = 0.01  # seconds per step of the timelines


# -- rank processes (spawned: no state shared with the parent but their arguments) --------------

def _train(batches_of, epochs: int, rate: float, barrier, extra=None) -> dict:
    """Run `epochs` epochs of `for batch in batches_of(epoch): sleep(len / rate)` after the
    barrier; every batch's arrival time and ids."""
    barrier.wait(timeout=300)
    out = []
    for epoch in range(epochs):
        start, arrivals, ids = time.time(), [], []
        for batch in batches_of(epoch):
            arrivals.append(time.time())
            ids.append(np.asarray(batch["index"]))
            if rate:
                time.sleep(len(ids[-1]) / rate)
        out.append({"start": start, "end": time.time(), "arrivals": arrivals,
                    "ids": np.concatenate(ids).tolist() if ids else []})
    return {"epochs": out, **(extra or {})}


def _dmdask_rank(address, url, cfg, rank, world, barrier, results) -> None:
    import distributed

    import dmdask

    with distributed.Client(address) as client:
        spec = dmdask.Spec(url, batch_size=cfg["batch"], block_size=cfg.get("block"), seed=SEED, rank=rank,
                           world_size=world)
        results.put(_train(lambda e: dmdask.batches(client, spec, epoch=e, progress=False), cfg["epochs"],
                           cfg["rate"], barrier))


def _baseline_rank(urls, cfg, rank, world, barrier, results) -> None:
    import torch.utils.data

    torch.set_num_threads(1)
    dataset = _Indexed(urls)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                                              seed=SEED)
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg["batch"], sampler=sampler,
                                         num_workers=cfg["loader_workers"], persistent_workers=True,
                                         multiprocessing_context="fork",  # as in a rank torchrun starts
                                         collate_fn=_collate)

    def epoch(e):
        sampler.set_epoch(e)
        return loader

    results.put(_train(epoch, cfg["epochs"], cfg["rate"], barrier))


class _Indexed:
    """Store files as a map-style dataset whose items carry their index (as dmdask's do)."""

    def __init__(self, urls):
        from .baselines import ProcessLocalFiles

        self.files = ProcessLocalFiles(urls)

    def __len__(self):
        return len(self.files)

    def __getitems__(self, indices):
        return [(data, i) for (data, _), i in zip(self.files.__getitems__(indices), indices)]


def _collate(items):
    from .baselines import collate

    batch = collate(items)
    return {"data": batch["data"], "index": batch["label"]}


def _warm_rank(address, path, cfg, rank, world, barrier, results) -> None:
    import distributed

    import dmdask

    with distributed.Client(address) as client:
        spec = dmdask.Spec(path, batch_size=cfg["batch"], rank=rank, world_size=world)
        results.put(_train(lambda e: dmdask.batches(client, spec, epoch=e, progress=False), cfg["epochs"], 0,
                           barrier))


def _spawn(target, world: int, *args) -> List[dict]:
    """`target(*args, rank, world, barrier, results)` in `world` new processes that start
    their epochs together; their reports by rank."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, rank, world, barrier, results)) for rank in range(world)]
    for p in procs:
        p.start()
    reports, deadline = [], time.monotonic() + 600
    try:
        while len(reports) < world:
            try:
                reports.append(results.get(timeout=1))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"rank processes of {target.__name__} failed (exit codes {dead}) "
                                       "or ran past 600 s") from None
        return reports
    finally:  # a rank that failed or hung must not outlive the measurement
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()


# -- the scenario --------------------------------------------------------------------------------

def run(preset: str) -> dict:
    import distributed

    from .store_server import StoreServer

    cfg = PRESETS[preset]
    started = time.perf_counter()
    n, world = cfg["samples"], cfg["world"]
    result: Dict[str, dict] = {"config": {k: v for k, v in cfg.items() if k != "warm"}, "loaders": {}}
    with workdir("cold") as root:
        paths = write_files(root + "/files", n, cfg["sample_bytes"])
        result["dataset_bytes"] = size = dataset_bytes(paths)
        with StoreServer(root, latency=cfg["latency"], bandwidth=cfg["bandwidth"]) as store:
            urls = [store.url + "/files/" + p.split("/files/", 1)[1] for p in paths]
            for loader in ("baseline", "dmdask"):  # the baseline forks its loaders before any cluster exists
                store.reset_stats()
                store.record_timeline()
                if loader == "baseline":
                    ranks = _spawn(_baseline_rank, world, urls, cfg)
                else:
                    per_worker = int(n * (cfg["sample_bytes"] + 16) / 2 * 1.25) + (16 << 20)
                    with dmdask_cluster(2, ram=per_worker) as cluster, distributed.Client(cluster):
                        ranks = _spawn(_dmdask_rank, world, cluster.scheduler_address, store.url + "/files", cfg)
                result["loaders"][loader] = _summary(ranks, store.timeline(), served_bytes(store)["bytes"] / size, n)
        result["warm"] = _warm_cache(root, cfg["warm"])
    result["seconds"] = time.perf_counter() - started
    result["goals"] = _goals(result)
    return result


def _warm_cache(root: str, cfg: dict) -> dict:
    """Part 2: a new process's first epoch on a warm cache against its second, for each
    dataset size (what the first epoch pays more: making the iterator, and the first
    touch of the mapped pages, which grows with the data)."""
    out = {"sample_bytes": cfg["sample_bytes"], "points": []}
    for n in cfg["samples"]:
        out["points"] += _warm_points(root, cfg, n)
    return out


def _warm_points(root: str, cfg: dict, n: int) -> List[dict]:
    import distributed
    import zarr

    sample_bytes = cfg["sample_bytes"]
    path = os.path.join(root, f"warm-{n}.zarr")
    group = zarr.open_group(path, mode="w")
    data = np.random.default_rng(0).integers(0, 256, size=(n, sample_bytes), dtype=np.uint8)
    group.create_array("x", shape=data.shape, chunks=(cfg["chunk"], sample_bytes), dtype="uint8")[:] = data
    group.create_array("label", shape=(n,), chunks=(cfg["chunk"],), dtype="int64")[:] = np.arange(n)
    del data
    ram = int(n * (sample_bytes + 8) * 0.75) + (32 << 20)  # each of 2 workers: more than half the dataset
    points = []
    with dmdask_cluster(2, ram=ram) as cluster, distributed.Client(cluster):
        address = cluster.scheduler_address
        _spawn(_warm_rank, 1, address, path, dict(cfg, epochs=1))  # loads the cache, then exits
        for world in cfg["ranks"]:
            runs = []  # each a new set of rank processes: one pair of epochs is too short to judge alone
            for _ in range(cfg["repeats"]):
                ranks = _spawn(_warm_rank, world, address, path, dict(cfg, epochs=2))
                runs.append([_span([r["epochs"][e] for r in ranks]) for e in (0, 1)]
                            + [all(_exactly_once([r["epochs"][e] for r in ranks], n) for e in (0, 1))])
            ratios = [ratio(first, second) for first, second, _ in runs]
            points.append({"samples": n, "ranks": world, "first_s": float(np.median([r[0] for r in runs])),
                           "second_s": float(np.median([r[1] for r in runs])), "ratio": float(np.median(ratios)),
                           "ratios": ratios, "exactly_once": all(r[2] for r in runs)})
    return points


def _span(epochs: List[dict]) -> float:
    """Wall time of one epoch over the ranks: the first start to the last end."""
    return max(e["end"] for e in epochs) - min(e["start"] for e in epochs)


def _exactly_once(epochs: List[dict], n: int) -> bool:
    ids = np.concatenate([np.asarray(e["ids"], dtype=np.int64) for e in epochs])
    return len(ids) == n and bool(np.array_equal(np.sort(ids), np.arange(n)))


def _summary(ranks: List[dict], gets: List[tuple], store_d: float, n: int) -> dict:
    """Epoch times, first-batch waits, the store's idle tail and the timelines of one loader."""
    epochs = len(ranks[0]["epochs"])
    t0 = min(r["epochs"][0]["start"] for r in ranks)
    per_epoch = []
    for e in range(epochs):
        these = [r["epochs"][e] for r in ranks]
        end = max(x["end"] for x in these)
        in_epoch = [g for g in gets if min(x["start"] for x in these) <= g[0] < end]
        per_epoch.append({"seconds": _span(these),
                          "first_batch_s": float(np.mean([x["arrivals"][0] - x["start"] for x in these])),
                          "end_minus_last_get_s": end - max((g[1] for g in in_epoch), default=end),
                          "first_get_s": (min((g[0] for g in in_epoch), default=end) - min(x["start"] for x in these)),
                          "exactly_once": _exactly_once(these, n)})
    end = max(r["epochs"][-1]["end"] for r in ranks)
    grid = np.arange(0.0, end - t0 + GRID, GRID)
    starts = np.sort([g[0] - t0 for g in gets])
    ends = np.sort([g[1] - t0 for g in gets])
    in_flight = np.searchsorted(starts, grid, side="right") - np.searchsorted(ends, grid, side="right")
    arrivals = np.sort([a - t0 for r in ranks for ep in r["epochs"] for a in ep["arrivals"]])
    delivered = np.searchsorted(arrivals, grid, side="right")
    return {"epochs": per_epoch, "store_d": store_d, "gets": len(gets),
            "timeline": {"t": grid.round(3).tolist(), "in_flight": in_flight.tolist(),
                         "batches": delivered.tolist(),
                         "epoch_ends": [max(r["epochs"][e]["end"] for r in ranks) - t0 for e in range(epochs)]}}


def _goals(result: dict) -> List[dict]:
    base, ours = result["loaders"]["baseline"]["epochs"][0], result["loaders"]["dmdask"]["epochs"][0]
    epoch1 = ratio(ours["seconds"], base["seconds"])
    first = ratio(ours["first_batch_s"], base["first_batch_s"])
    store_d = result["loaders"]["dmdask"]["store_d"]
    goals = [
        {"goal": "epoch 1 with a training step, rank processes: dmdask <= 1.0x DataLoader + DistributedSampler "
                 "(moonshot 0.8x)", "met": epoch1 <= 1.0,
         "measured": f"dmdask / baseline = {epoch1:.2f} ({ours['seconds']:.2f} s vs {base['seconds']:.2f} s)"},
        {"goal": "... its first batch <= 1.5x the baseline's", "met": first <= 1.5,
         "measured": f"dmdask / baseline = {first:.2f} ({ours['first_batch_s']:.2f} s vs "
                     f"{base['first_batch_s']:.2f} s)"},
        {"goal": "... every byte from the store once over all epochs, every sample once per epoch",
         "met": abs(store_d - 1) < 0.02 and all(e["exactly_once"] for e in result["loaders"]["dmdask"]["epochs"]),
         "measured": f"{store_d:.3f} D"},
    ]
    for p in result["warm"]["points"]:
        goals.append({"goal": f"a new process on a warm cache: first epoch <= 1.3x its second ({p['ranks']} "
                              f"rank{'s' if p['ranks'] > 1 else ''}, {p['samples']:,} samples)",
                      "met": p["ratio"] <= 1.3 and p["exactly_once"],
                      "measured": f"{p['ratio']:.2f}, median of {len(p.get('ratios', [0]))} runs ({p['first_s']:.3f} s vs "
                                  f"{p['second_s']:.3f} s: {(p['first_s'] - p['second_s']) * 1e3:.0f} ms more)"})
    return goals


# -- the report ----------------------------------------------------------------------------------

def report(result: dict, plots_dir: str) -> str:
    cfg = result["config"]
    lines = [
        f"Part 1: {cfg['samples']:,} files of {cfg['sample_bytes']:,} B (D = {result['dataset_bytes'] / 2**20:.1f} "
        f"MiB) on a store throttled to {cfg['bandwidth'] / 2**20:.0f} MiB/s in all and {cfg['latency'] * 1e3:.0f} ms "
        f"a request; {cfg['world']} rank processes started together, each with an emulated step of batch / "
        f"{cfg['rate']:,} samples/s after each batch of {cfg['batch']}, {cfg['epochs']} epochs. Baseline: "
        f"DataLoader(num_workers={cfg['loader_workers']}, persistent_workers) + DistributedSampler per rank, "
        "reading the store. dmdask: a fresh 2-worker LocalCluster whose RAM holds the dataset (cold), blocks of "
        f"{cfg['block']} files. First batch: from the epoch's start (creating its iterator) to the first batch, "
        "averaged over the ranks; tail: epoch end minus the end of its last GET.",
        "",
        "| loader | epoch 1 | epoch 2 | first batch (epoch 1) | first GET after | tail (epoch 1) | store bytes / D | GETs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"baseline": "DataLoader + DistributedSampler", "dmdask": "dmdask"}
    for name, r in result["loaders"].items():
        e = r["epochs"]
        second = f"{e[1]['seconds']:.2f} s" if len(e) > 1 else "-"
        lines.append(f"| {names[name]} | {e[0]['seconds']:.2f} s | {second} | {e[0]['first_batch_s']:.2f} s | "
                     f"{e[0]['first_get_s']:.2f} s | {e[0]['end_minus_last_get_s']:.2f} s | {r['store_d']:.2f} | "
                     f"{r['gets']:,} |")
    plot = _plot(result, plots_dir)
    if plot:
        lines += ["", f"![store requests in flight and batches delivered](benchmarks/{plot})"]
    w = result["warm"]
    lines += ["", f"Part 2: a warm cache (samples of {w['sample_bytes']:,} B in the RAM of 2 workers, loaded by "
                  "another process), new rank processes, two epochs each, no compute. What the first epoch pays "
                  "more: making the iterator (one request opens the dataset and names where its blocks are and "
                  "how this node's are laid out, which the scheduler keeps while no block comes or goes; "
                  "the arenas named once each, not block by block; mapping them: 4-6 ms against 2 ms), the "
                  "first touch of the arenas' pages (faulted in by another thread as they are mapped, one fault "
                  "per 2 MiB where huge pages are allowed) "
                  "and the zeroing of the fresh pooled output memory (a chunk per batch: about 8 MiB a rank at "
                  "the default prefetch, faulted in ahead by another thread where it can: a fixed cost, slow in "
                  "a VM). "
                  "Each point: the medians of "
                  "several runs, each with new rank processes (first / second: the median of the runs' ratios).", "",
              "| samples | ranks | first epoch | second epoch | first - second | first / second | runs' ratios | "
              "every sample once |",
              "|---:|---:|---:|---:|---:|---:|---|:-:|"]
    for p in w["points"]:
        lines.append(f"| {p.get('samples', 0):,} | {p['ranks']} | {p['first_s']:.3f} s | {p['second_s']:.3f} s | "
                     f"{(p['first_s'] - p['second_s']) * 1e3:.0f} ms | {p['ratio']:.2f} | "
                     f"{', '.join(f'{r:.2f}' for r in p.get('ratios', [p['ratio']]))} | "
                     f"{'yes' if p['exactly_once'] else 'no'} |")
    lines.append(f"\nWhole scenario: {result['seconds']:.0f} s.\n")
    return "\n".join(lines) + "\n"


def _plot(result: dict, plots_dir: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(result["loaders"]), 1, figsize=(9, 5), sharex=True)
    for ax, (name, r) in zip(np.atleast_1d(axes), result["loaders"].items()):
        t = r["timeline"]
        ax.fill_between(t["t"], t["in_flight"], step="post", alpha=0.4, label="store GETs in flight")
        ax.set_ylabel(f"{name}\nGETs in flight")
        right = ax.twinx()
        right.plot(t["t"], t["batches"], color="black", label="batches delivered (all ranks)")
        right.set_ylabel("batches")
        for end in t["epoch_ends"]:
            ax.axvline(end, color="grey", linestyle=":")
        ax.legend(loc="upper left", fontsize=8)
        right.legend(loc="lower right", fontsize=8)
    np.atleast_1d(axes)[-1].set_xlabel("seconds since the first rank started epoch 1 (dotted: epoch ends)")
    fig.tight_layout()
    os.makedirs(plots_dir, exist_ok=True)
    fig.savefig(os.path.join(plots_dir, "cold.png"), dpi=90)
    plt.close(fig)
    return "cold.png"
