"""Scenario 3: loader throughput with a warm cache and no compute, exact global shuffle.

dmdask against, in the same run: the raw ceiling of the transport (gathering the whole
cached blocks from the workers and shuffling them in the trainer), numpy fancy indexing
of arrays already in memory, and PyTorch's DataLoader(num_workers=2) over local files;
then the aggregate throughput of 1, 2, 4, 8 rank processes on the node.
Also records peak memory (scenario 5): trainer and workers against the capacities.
"""
from __future__ import annotations

import multiprocessing
import os
import time

import distributed
import numpy as np

import dmdask
from dmdask.worker import load_block

from .common import dmdask_cluster, peak_rss_mib, workdir

PRESETS = {
    "tiny": {"sizes": {"3KB": (3072, 600, 100)}, "batch": 64, "epochs": 2, "rounds": 2, "ranks": [1, 2],
             "rank_epochs": 2, "sweeps": 1},
    "quick": {"sizes": {"3KB": (3072, 40000, 500), "110KB": (112640, 2000, 20)}, "batch": 256, "epochs": 3,
              "rounds": 6, "ranks": [1, 2, 4, 8], "rank_epochs": 10, "sweeps": 2},
    "full": {"sizes": {"3KB": (3072, 200000, 1000), "110KB": (112640, 10000, 25)}, "batch": 256, "epochs": 5,
             "rounds": 8, "ranks": [1, 2, 4, 8], "rank_epochs": 10, "sweeps": 3},
}


def run(preset: str) -> dict:
    import zarr

    cfg = PRESETS[preset]
    rows = []
    with workdir("throughput") as root:
        for name, (sample_bytes, n, chunk) in cfg["sizes"].items():
            rng = np.random.default_rng(0)
            data = rng.integers(0, 256, size=(n, sample_bytes), dtype=np.uint8)
            path = f"{root}/{name}.zarr"
            group = zarr.open_group(path, mode="w")
            group.create_array("x", shape=data.shape, chunks=(chunk, sample_bytes), dtype="uint8")[:] = data
            group.create_array("label", shape=(n,), chunks=(chunk,), dtype="int64")[:] = np.arange(n)
            folder = _write_local_files(f"{root}/{name}-files", data)
            row = {"size": name, "sample_bytes": sample_bytes, "samples": n, "chunk": chunk}
            numpy_epoch = _numpy_epoch(data, cfg)
            row["torch_dataloader"] = _torch_files(folder, cfg)
            with_ranks = name == next(iter(cfg["sizes"]))  # the rank curve at the smallest samples only
            row.update(_dmdask_and_ceiling(path, n * (sample_bytes + 8), cfg, with_ranks, numpy_epoch))
            rows.append(row)
            del data
    goals = [{
        "goal": f"a warm epoch of one rank runs at >= {want}x numpy fancy indexing in the trainer's memory "
                f"({r['size']} samples)",
        "met": r["dmdask"]["samples_per_s"] >= want * r["numpy"]["samples_per_s"],
        "measured": f"dmdask / numpy = {r['dmdask']['samples_per_s'] / r['numpy']['samples_per_s']:.2f}",
    } for r in rows for want in [NUMPY_GOALS.get(r["size"], 0.5)]]
    first = rows[0]
    four = next((p for p in first["ranks"] if p["ranks"] == 4), None)
    if four is not None:
        one = first["ranks"][0]["samples_per_s"]
        goals.append({"goal": f"4 rank processes on the node together reach >= 1.5x one rank ({first['size']})",
                      "met": four["samples_per_s"] >= 1.5 * one,
                      "measured": " / ".join(f"{p['ranks']} ranks {p['samples_per_s'] / one:.2f}x"
                                             for p in first["ranks"])})
    goals += [{
        "goal": f"dmdask reaches at least half the transport ceiling ({r['size']} samples)",
        "met": r["dmdask"]["samples_per_s"] >= 0.5 * r["ceiling"]["samples_per_s"],
        "measured": f"dmdask / ceiling = {r['dmdask']['samples_per_s'] / r['ceiling']['samples_per_s']:.2f}",
    } for r in rows]
    goals += [{
        "goal": f"workers' RAM stays within the configured capacity plus one block per thread ({r['size']})",
        "met": r["memory"]["worker_cache_mib"] <= r["memory"]["capacity_mib"] + r["memory"]["block_mib"],
        "measured": f"cached {r['memory']['worker_cache_mib']:.1f} MiB of {r['memory']['capacity_mib']:.1f} MiB; "
                    f"worker peak RSS {r['memory']['worker_peak_rss_mib']:.0f} MiB",
    } for r in rows]
    return {"config": cfg, "rows": rows, "goals": goals}


NUMPY_GOALS = {"3KB": 0.5, "110KB": 0.8}


def _timed(epochs: int, one_epoch) -> dict:
    """Warm-up epoch, then the best samples/s over `epochs` epochs."""
    one_epoch(0)
    rates = []
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        count = one_epoch(epoch)
        rates.append(count / (time.perf_counter() - started))
    return {"samples_per_s": max(rates), "all": rates}


def _interleaved(epochs: int, **loaders) -> dict:
    """Like `_timed` for several loaders, their epochs taken in turns, so that a noisy
    neighbour slows them alike: {name: {"samples_per_s": best, "all": [...]}}."""
    for one_epoch in loaders.values():
        one_epoch(0)
    rates = {name: [] for name in loaders}
    for epoch in range(1, epochs + 1):
        for name, one_epoch in loaders.items():
            started = time.perf_counter()
            count = one_epoch(epoch)
            rates[name].append(count / (time.perf_counter() - started))
    return {name: {"samples_per_s": max(r), "all": r} for name, r in rates.items()}


def _numpy_epoch(data: np.ndarray, cfg):
    """One epoch of numpy fancy indexing, a batch at a time, of arrays in this process's memory."""
    batch = cfg["batch"]
    labels = np.arange(len(data))

    def epoch(e):
        order = np.random.default_rng(e).permutation(len(data))
        for i in range(0, len(order), batch):
            _ = data[order[i:i + batch]], labels[order[i:i + batch]]
        return len(order)

    return epoch


def _write_local_files(folder: str, data: np.ndarray) -> str:
    os.makedirs(folder, exist_ok=True)
    for i, row in enumerate(data):
        with open(f"{folder}/{i:08d}.bin", "wb") as f:
            f.write(row.tobytes())
    return folder


class _LocalFiles:
    def __init__(self, folder: str, n: int):
        self.paths = [f"{folder}/{i:08d}.bin" for i in range(n)]

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)


def _torch_files(folder: str, cfg) -> dict:
    import torch.utils.data

    dataset = _LocalFiles(folder, len(os.listdir(folder)))

    def epoch(e):
        torch.manual_seed(e)
        loader = torch.utils.data.DataLoader(dataset, batch_size=cfg["batch"], shuffle=True, num_workers=2,
                                             collate_fn=lambda items: np.stack(items))
        return sum(len(b) for b in loader)

    return _timed(cfg["epochs"], epoch)


def _dmdask_and_ceiling(path: str, dataset_bytes: int, cfg, with_ranks: bool, numpy_epoch) -> dict:
    capacity = int(dataset_bytes * 0.6) + (64 << 20)  # per worker: both together hold the dataset
    with dmdask_cluster(2, ram=capacity) as cluster, distributed.Client(cluster) as client:
        rss_empty = max(client.run(_rss_mib).values())
        spec = dmdask.Spec(path, batch_size=cfg["batch"], prefetch=16)

        def dmdask_epoch(e):
            return sum(len(b["index"]) for b in dmdask.batches(client, spec, epoch=e))

        side_by_side = _interleaved(cfg["rounds"], numpy=numpy_epoch, dmdask=dmdask_epoch)
        # futures of the cached blocks: the same keys again return the blocks already held
        source = dmdask.source.open_source(spec)
        readers = [source.reader(k) for k in range(source.info.num_blocks)]
        futures = client.map(load_block, readers, key=[r.key for r in readers], pure=False)

        def ceiling_epoch(e):
            blocks = client.gather(futures, direct=True)
            arrays = {f: np.concatenate([b.arrays[f] for b in blocks]) for f in blocks[0].arrays}
            order = np.random.default_rng(e).permutation(len(arrays["x"]))
            for i in range(0, len(order), cfg["batch"]):
                _ = {f: a[order[i:i + cfg["batch"]]] for f, a in arrays.items()}
            return len(order)

        ceiling = _timed(cfg["epochs"], ceiling_epoch)
        ranks = _rank_curve(cluster.scheduler_address, path, cfg) if with_ranks else []
        stats = dmdask.stats(client)
        peak = client.run(_peak_rss_mib)
        memory = {
            "capacity_mib": capacity / 2**20,
            "block_mib": dataset_bytes / source.info.num_blocks / 2**20,
            "worker_cache_mib": max(s["ram"]["bytes"] for s in stats["workers"].values()) / 2**20,
            "worker_peak_rss_mib": max(peak.values()),
            "worker_rss_empty_mib": rss_empty,
            "trainer_peak_rss_mib": _peak_rss_mib(),
            "dataset_mib": dataset_bytes / 2**20,
        }
        dmdask.release(client, spec)
    return {**side_by_side, "ceiling": ceiling, "memory": memory, "ranks": ranks}


RUNS = 2  # timed runs per set of rank processes


def _rank_curve(address: str, path: str, cfg) -> list:
    """The aggregate rate of each number of ranks, measured in sweeps over all of them
    (1, 2, 4, 8, 1, 2, 4, 8, ...) so that a noisy spell hits every point alike; the best
    of each point's runs counts."""
    sweeps = [[_ranks(address, path, world, cfg) for world in cfg["ranks"]] for _ in range(cfg["sweeps"])]
    best = []
    for points in zip(*sweeps):
        rates = [rate for point in points for rate in point["all"]]
        best.append({**points[0], "samples_per_s": max(rates), "all": rates,
                     "rank_peak_rss_mib": max(p["rank_peak_rss_mib"] for p in points)})
    return best


def _ranks(address: str, path: str, world: int, cfg) -> dict:
    """`world` rank processes on this node, each reading its share of warm epochs; the
    epochs start together (a barrier). Aggregate samples/s of the best epoch."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_rank_process, args=(address, path, rank, world, cfg, barrier, results))
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=600) for _ in procs]
    finally:  # a rank that failed or hung must not outlive the measurement
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    rates = []
    for run in range(RUNS):
        spans = [r["runs"][run] for r in reports]
        samples = sum(n for _, _, n in spans)
        rates.append(samples / (max(end for _, end, _ in spans) - min(start for start, _, _ in spans)))
    return {"ranks": world, "samples_per_s": max(rates), "all": rates,
            "rank_peak_rss_mib": max(r["peak_rss_mib"] for r in reports)}


def _rank_process(address, path, rank, world, cfg, barrier, results) -> None:
    client = distributed.Client(address)
    spec = dmdask.Spec(path, batch_size=cfg["batch"], prefetch=16, rank=rank, world_size=world)
    sum(len(b["index"]) for b in dmdask.batches(client, spec, epoch=0))  # maps the arenas, not timed
    runs = []
    for run in range(RUNS):  # each: rank_epochs epochs back to back, started together
        barrier.wait(timeout=300)  # a rank that died breaks the barrier: the others stop too
        started = time.time()
        count = sum(len(b["index"]) for epoch in range(1, cfg["rank_epochs"] + 1)
                    for b in dmdask.batches(client, spec, epoch=epoch))
        runs.append((started, time.time(), count))
    results.put({"rank": rank, "runs": runs, "peak_rss_mib": peak_rss_mib()})
    client.close()


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_rss_mib() -> float:
    return peak_rss_mib()


def report(result: dict, plots_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [("ceiling", "transport ceiling (gather blocks)"), ("dmdask", "dmdask"),
             ("numpy", "numpy indexing in memory"), ("torch_dataloader", "DataLoader(num_workers=2), local files")]
    lines = ["| sample | " + " | ".join(label for _, label in names) + " | dmdask / ceiling |",
             "|---|" + "---:|" * (len(names) + 1)]
    for r in rows:
        cells = [f"{r[k]['samples_per_s']:,.0f}/s" for k, _ in names]
        lines.append(f"| {r['size']} | " + " | ".join(cells)
                     + f" | {r['dmdask']['samples_per_s'] / r['ceiling']['samples_per_s']:.2f} |")
    mem = ["| sample | dataset | RAM capacity / worker | cached on the fullest worker | worker RSS empty -> peak "
           "| trainer peak RSS |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["memory"]
        mem.append(f"| {r['size']} | {m['dataset_mib']:.0f} MiB | {m['capacity_mib']:.0f} MiB "
                   f"| {m['worker_cache_mib']:.0f} MiB | {m['worker_rss_empty_mib']:.0f} -> "
                   f"{m['worker_peak_rss_mib']:.0f} MiB | {m['trainer_peak_rss_mib']:.0f} MiB |")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(names)
    for j, (key, label) in enumerate(names):
        ax.bar([i + j * width for i in range(len(rows))], [r[key]["samples_per_s"] for r in rows], width,
               label=label)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['size']} samples" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (warm, no compute)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{plots_dir}/throughput.png", dpi=110)
    plt.close(fig)
    one = rows[0]["ranks"][0]["samples_per_s"]
    scaling = ["| rank processes | aggregate samples/s | vs one rank | peak RSS of a rank |", "|---:|---:|---:|---:|"]
    for p in rows[0]["ranks"]:
        scaling.append(f"| {p['ranks']} | {p['samples_per_s']:,.0f}/s | {p['samples_per_s'] / one:.2f}x "
                       f"| {p['rank_peak_rss_mib']:.0f} MiB |")
    return ("Warm cache (epoch 0 loads it and is not timed), batch "
            f"{result['config']['batch']}, one trainer, 2 worker processes. dmdask and numpy run their epochs in "
            f"turns ({result['config']['rounds']} each, best counted), so that a noisy neighbour slows both alike; "
            "numpy indexes the data and labels of a batch from arrays in the trainer's memory and drops them at "
            "once, while dmdask keeps 16 batches prefetched. The others: best of "
            f"{result['config']['epochs']} epochs. The ceiling gathers every cached block to the trainer "
            "and permutes there (needs the whole dataset in the trainer's memory).\n\n"
            + "\n".join(lines) + "\n\n![throughput](benchmarks/throughput.png)\n\n"
            f"**Ranks on one node** ({rows[0]['size']} samples, the same cluster): each rank a process of its own "
            f"reading its share (rank r of world_size) for {result['config']['rank_epochs']} epochs back to back, "
            "started together; aggregate = the samples of all ranks / (last end - first start), best of "
            f"{RUNS * result['config']['sweeps']} runs, taken in sweeps over the numbers of ranks."
            "\n\n" + "\n".join(scaling) + "\n\n"
            "**Memory** (scenario 5): peak resident memory against the configured capacities.\n\n"
            + "\n".join(mem) + "\n")
