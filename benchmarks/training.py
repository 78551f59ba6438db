"""Scenario 2: training time when the shared store is the bottleneck.

A folder of per-sample files sits on a throttled `StoreServer` (a per-request latency
and an aggregate bandwidth cap: the stand-in for a contended shared file system), sized
so that reading the dataset once takes clearly longer than one epoch of compute. The
same training loop runs over each loader, and the trainer times each `next(batch)`:

- ideal: the same loop over arrays already in the trainer's memory;
- baseline: PyTorch DataLoader + DistributedSampler reading the store directly
  (`baselines.StoreFiles`, persistent loader worker processes);
- Ray Data: `ray.data.read_binary_files` on the same URLs through the same store,
  files shuffled every epoch, `streaming_split` for the ranks, `iter_torch_batches`;
- dmdask: `dmdask.batches` on a 2-worker `LocalCluster` whose cache holds the dataset.

Compute is emulated per batch (a sleep of batch_size / the stated samples/s, so two cores
do not distort it) and, separately, a small real PyTorch CNN trains on the decoded bytes.
Reported: epoch 1 and epochs 2+ wall times, and the data-stall fraction (time the
trainer waits for a batch, including creating the epoch's iterator, over epoch time).
"""
from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from typing import Callable, Dict, List

import distributed
import fsspec
import numpy as np

import dmdask

from .baselines import ProcessLocalFiles, collate
from .common import dataset_bytes, dmdask_cluster, ratio, run_ranks, served_bytes, workdir, write_files

# samples, sample_bytes: the files on the store. rate: the emulated compute, samples/s per
# rank. latency (s a request) and bandwidth (bytes/s, all clients together): the store.
# block: files per dmdask block. loader_workers: the baseline DataLoader's num_workers.
# ray_epochs: epochs for Ray Data (slow to start and to run here). model: the real-model
# part (its own ranks, epochs and loaders).
PRESETS = {
    "tiny": {"samples": 512, "sample_bytes": 4096, "batch": 32, "world": 2, "epochs": 2, "rate": 4000,
             "latency": 0.001, "bandwidth": 2 * 2**20, "block": 32, "loader_workers": 2,
             "ray": False, "ray_epochs": 2,
             "model": {"ranks": 1, "epochs": 2, "loaders": ["ideal", "dmdask"]}},
    "quick": {"samples": 3072, "sample_bytes": 16384, "batch": 32, "world": 2, "epochs": 3, "rate": 1000,
              "latency": 0.002, "bandwidth": 16 * 2**20, "block": 64, "loader_workers": 2,
              "ray": True, "ray_epochs": 2,
              "model": {"ranks": 1, "epochs": 3, "loaders": ["ideal", "baseline", "dmdask"]}},
    "full": {"samples": 16384, "sample_bytes": 16384, "batch": 64, "world": 2, "epochs": 4, "rate": 1500,
             "latency": 0.002, "bandwidth": 24 * 2**20, "block": 128, "loader_workers": 2,
             "ray": True, "ray_epochs": 2,
             "model": {"ranks": 1, "epochs": 4, "loaders": ["ideal", "baseline", "dmdask"]}},
}
SEED = 0
LOADERS = [("ideal", "ideal (arrays in memory)"), ("baseline", "DataLoader + DistributedSampler"),
           ("ray", "Ray Data"), ("dmdask", "dmdask")]


# -- the trainer loop -----------------------------------------------------------------------

def _run_epochs(world: int, epochs: int, epoch_iter: Callable[[int, int], object],
                step: Callable[[int, object], int], setup_wait: float = 0.0) -> dict:
    """Every rank runs `epochs` epochs of `for batch in epoch_iter(rank, epoch): step(rank, batch)`.

    Ranks are threads started together for each epoch. An epoch's time is the wall time
    until its last rank finishes; a rank's wait is the time spent creating the iterator
    and in `next()`; stall = wait / epoch time, averaged over the ranks. `setup_wait`
    (seconds spent building the loader before epoch 1) counts in epoch 1 as waiting."""
    out = []
    for epoch in range(epochs):
        start = time.perf_counter()

        def rank(r):
            samples = 0
            t = time.perf_counter()
            it = iter(epoch_iter(r, epoch))
            opened = waited = time.perf_counter() - t
            while True:
                t = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    waited += time.perf_counter() - t
                    break
                waited += time.perf_counter() - t
                samples += step(r, batch)
            return waited, opened, samples

        per_rank = run_ranks(world, rank)
        seconds = time.perf_counter() - start
        extra = setup_wait if epoch == 0 else 0.0
        seconds += extra
        waits = [w + extra for w, _, _ in per_rank]
        out.append({"seconds": seconds, "wait_s": waits, "stall": float(np.mean(waits)) / seconds,
                    "start_s": [o + extra for _, o, _ in per_rank], "samples": sum(n for _, _, n in per_rank)})
    later = out[1:] or out
    return {"epochs": out, "epoch1_s": out[0]["seconds"], "stall1": out[0]["stall"],
            "later_s": float(np.mean([e["seconds"] for e in later])),
            "later_stall": float(np.mean([e["stall"] for e in later])),
            "later_start_s": float(np.mean([np.mean(e["start_s"]) for e in later])),
            "setup_s": setup_wait}


def _rows(batch) -> int:
    data = batch["data"]
    return int(data.shape[0]) if hasattr(data, "shape") else len(data)


class Emulated:
    """Compute emulated by a sleep of rows / rate per batch."""

    def __init__(self, rate: float):
        self.rate = rate

    def __call__(self, rank: int, batch) -> int:
        n = _rows(batch)
        time.sleep(n / self.rate)
        return n


class Model:
    """A small CNN trained on the sample bytes decoded as a (1, side, side) float image.

    One model and optimizer per rank (ranks are threads: no gradient exchange)."""

    def __init__(self, ranks: int, sample_bytes: int, seed: int = SEED):
        import torch

        self.side = int(math.isqrt(sample_bytes))
        torch.manual_seed(seed)
        self.models = [self._net() for _ in range(ranks)]
        self.optims = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in self.models]

    @staticmethod
    def _net():
        import torch.nn as nn

        return nn.Sequential(nn.Conv2d(1, 16, 5, stride=4, padding=2), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def decode(self, batch):
        """Bytes -> float tensor (n, 1, side, side) in [0, 1], labels -> int64 tensor."""
        import torch

        data = batch["data"]
        if isinstance(data, torch.Tensor):
            data = data.numpy()
        if data.dtype == object:
            data = np.stack(data)
        pixels = np.ascontiguousarray(data[:, :self.side * self.side]).reshape(-1, 1, self.side, self.side)
        x = torch.from_numpy(pixels).float().div_(255)
        y = torch.as_tensor(np.asarray(batch["label"]), dtype=torch.int64)
        return x, y

    def __call__(self, rank: int, batch) -> int:
        import torch.nn.functional as F

        x, y = self.decode(batch)
        opt = self.optims[rank]
        opt.zero_grad()
        F.cross_entropy(self.models[rank](x), y).backward()
        opt.step()
        return len(y)


# -- the loaders ------------------------------------------------------------------------------

def _ideal(data: np.ndarray, labels: np.ndarray, world: int, batch: int):
    """A fresh permutation each epoch, padded and split over the ranks as DistributedSampler
    does, over arrays already in memory (each batch a copy, as a loader hands out)."""
    n = len(data)
    per_rank = -(-n // world)

    def epoch_iter(rank, epoch):
        order = np.random.default_rng([SEED, epoch]).permutation(n)
        order = np.concatenate([order, order[:per_rank * world - n]])[rank::world]
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            yield {"data": data[idx], "label": labels[idx]}

    return epoch_iter


def _baseline(urls: List[str], labels: List[int], world: int, batch: int, num_workers: int):
    """DataLoader + DistributedSampler per rank, created once, `set_epoch` every epoch
    (as in PyTorch's DDP tutorial); loader workers persist across epochs."""
    import torch.utils.data

    dataset = ProcessLocalFiles(urls, labels)
    samplers = [torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=r,
                                                                shuffle=True, seed=SEED) for r in range(world)]
    extra = {"persistent_workers": True, "prefetch_factor": 2} if num_workers else {}
    loaders = [torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=s, num_workers=num_workers,
                                           collate_fn=collate, **extra) for s in samplers]
    start_lock = threading.Lock()  # start one rank's worker processes at a time (fork from threads)

    def epoch_iter(rank, epoch):
        samplers[rank].set_epoch(epoch)
        with start_lock:
            return iter(loaders[rank])

    def close():
        for loader in loaders:
            it = getattr(loader, "_iterator", None)
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()

    return epoch_iter, close


def _dmdask(client, url: str, world: int, batch: int, block: int):
    spec = dmdask.Spec(url, batch_size=batch, block_size=block, seed=SEED)
    iterators = {}

    def epoch_iter(rank, epoch):
        it = dmdask.batches(client, spec.replace(rank=rank, world_size=world), epoch=epoch, progress=False)
        iterators[(rank, epoch)] = it
        return it

    return spec, epoch_iter, iterators


class _OneGetHandler:
    """pyarrow filesystem handler over fsspec's HTTP filesystem that reads a file with one
    GET (pyarrow's stock `FSSpecHandler` opens a seekable fsspec file: a sizing GET, a
    HEAD and a ranged GET, twice the bytes)."""

    @staticmethod
    def make():
        import pyarrow as pa
        import pyarrow.fs as pafs

        class Handler(pafs.FSSpecHandler):
            def open_input_stream(self, path):
                return pa.BufferReader(self.fs.cat_file(path))

            def open_input_file(self, path):
                return pa.BufferReader(self.fs.cat_file(path))

        return pafs.PyFileSystem(Handler(fsspec.filesystem("http")))


def _decode_ray(batch):
    return {"data": np.stack([np.frombuffer(b, dtype=np.uint8) for b in batch["bytes"]])}


def _ray_run(urls: List[str], cfg: dict, step, store) -> dict:
    """Ray Data over the same URLs; {"status": "not run", "reason": ...} when Ray can't run."""
    try:
        import ray
        import ray.data
        from ray.data import FileShuffleConfig
    except Exception as exc:  # noqa: BLE001 - any import failure means "not run"
        return {"status": "not run", "reason": f"ray[data] is not importable: {type(exc).__name__}: {exc}"}
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    started = time.perf_counter()
    try:
        ray.init(num_cpus=cfg["world"], include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=False)
    except Exception as exc:  # noqa: BLE001
        return {"status": "not run", "reason": f"ray.init failed: {type(exc).__name__}: {exc}"}
    try:
        init_s = time.perf_counter() - started
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        store.reset_stats()
        t = time.perf_counter()
        ds = ray.data.read_binary_files(urls, filesystem=_OneGetHandler.make(),
                                        shuffle=FileShuffleConfig(seed=SEED, reseed_after_execution=True))
        ds = ds.map_batches(_decode_ray, batch_format="numpy")
        splits = ds.streaming_split(cfg["world"], equal=True)
        setup = time.perf_counter() - t

        def epoch_iter(rank, epoch):
            return splits[rank].iter_torch_batches(batch_size=cfg["batch"])

        out = _run_epochs(cfg["world"], cfg["epochs"], epoch_iter, step, setup_wait=setup)
        out.update(status="ok", store=_store_counts(store), init_s=init_s, version=ray.__version__)
        return out
    except Exception as exc:  # noqa: BLE001 - report, don't fail the scenario
        return {"status": "not run", "reason": f"{type(exc).__name__}: {exc}"}
    finally:
        ray.shutdown()


# -- the scenario -------------------------------------------------------------------------------

def run(preset: str) -> dict:
    from .store_server import StoreServer

    cfg = PRESETS[preset]
    warnings.filterwarnings("ignore")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    started = time.perf_counter()
    n, world, mcfg = cfg["samples"], cfg["world"], cfg["model"]
    parts = {"emulated": {"ranks": world, "epochs": cfg["epochs"], "step": lambda: Emulated(cfg["rate"]),
                          "loaders": ["ideal", "baseline", "dmdask"] + (["ray"] if cfg["ray"] else [])},
             "model": {"ranks": mcfg["ranks"], "epochs": mcfg["epochs"], "loaders": mcfg["loaders"],
                       "step": lambda: Model(mcfg["ranks"], cfg["sample_bytes"])}}
    results: Dict[str, dict] = {part: {} for part in parts}
    with workdir("training") as root:
        paths = write_files(root + "/files", n, cfg["sample_bytes"])
        size = dataset_bytes(paths)
        labels = np.arange(n) // -(-n // 10)  # write_files' class folders
        data = np.stack([np.fromfile(p, dtype=np.uint8) for p in paths])  # the ideal's arrays
        with StoreServer(root, latency=cfg["latency"], bandwidth=cfg["bandwidth"]) as store, _torch_threads(1):
            urls = [store.url + "/files/" + p.split("/files/", 1)[1] for p in paths]
            # the loaders that fork worker processes run before any cluster exists
            for part, p in parts.items():
                if "ideal" in p["loaders"]:
                    results[part]["ideal"] = _run_epochs(p["ranks"], p["epochs"],
                                                         _ideal(data, labels, p["ranks"], cfg["batch"]), p["step"]())
                if "baseline" in p["loaders"]:
                    results[part]["baseline"] = _baseline_run(cfg, p, urls, labels, store)
            # one dmdask cluster; its cache is dropped between the parts (each starts cold)
            per_worker = int(n * (cfg["sample_bytes"] + 16) / 2 * 1.25) + (16 << 20)  # both hold the dataset
            with dmdask_cluster(2, ram=per_worker) as cluster, distributed.Client(cluster) as client:
                for part, p in parts.items():
                    if "dmdask" in p["loaders"]:
                        results[part]["dmdask"] = _dmdask_run(client, cfg, p, store)
            if "ray" in parts["emulated"]["loaders"]:
                p = parts["emulated"]
                results["emulated"]["ray"] = _ray_run(urls, dict(cfg, world=p["ranks"], epochs=cfg["ray_epochs"]),
                                                      p["step"](), store)
    if not cfg["ray"]:
        results["emulated"]["ray"] = {"status": "not run",
                                      "reason": f"skipped in the {preset!r} preset (Ray takes ~15 s to start)"}
    result = {
        "config": cfg, "dataset_bytes": size, "store_floor_s": size / cfg["bandwidth"],
        "compute_s": n / (world * cfg["rate"]), "model_samples_per_s": n / results["model"]["ideal"]["later_s"],
        "emulated": results["emulated"], "model": results["model"], "runtime_s": time.perf_counter() - started,
    }
    result["goals"] = _goals(result)
    return result


class _torch_threads:
    """Torch intra-op threads for the block: on two cores, more only fight the loaders."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        import torch

        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        import torch

        torch.set_num_threads(self.before)


def _store_counts(store) -> dict:
    """Sample-file bytes and requests sent by the store, and its metadata requests
    (directory listings and HEADs)."""
    stats = store.stats()
    files = served_bytes(store)
    return dict(files, listings=stats["requests"] - files["requests"], heads=stats["head_requests"])


def _baseline_run(cfg, p, urls, labels, store) -> dict:
    store.reset_stats()
    epoch_iter, close = _baseline(urls, labels.tolist(), p["ranks"], cfg["batch"], cfg["loader_workers"])
    try:
        out = _run_epochs(p["ranks"], p["epochs"], epoch_iter, p["step"]())
    finally:
        close()
    out["store"] = _store_counts(store)
    return out


def _dmdask_run(client, cfg, p, store) -> dict:
    world, epochs = p["ranks"], p["epochs"]
    store.reset_stats()
    spec, epoch_iter, iterators = _dmdask(client, store.url + "/files", world, cfg["batch"], cfg["block"])
    out = _run_epochs(world, epochs, epoch_iter, p["step"]())
    out["store"] = _store_counts(store)
    # BatchIterator.wait_seconds: the part of the wait spent in next(), not in creating the iterator
    out["next_wait_s"] = [float(np.mean([iterators[(r, e)].wait_seconds for r in range(world)]))
                          for e in range(epochs)]
    total = dmdask.stats(client)["total"]
    out["cache"] = {"ram_bytes": total["ram"]["bytes"], "blocks": total["ram"]["blocks"],
                    "streamed_blocks": total["streamed_blocks"]}
    iterators.clear()  # they hold the block futures: drop them so that release empties the cache
    dmdask.release(client, spec)
    _wait_forgotten(client)
    return out


def _count_blocks(dask_scheduler) -> int:
    return sum(1 for k in dask_scheduler.tasks if isinstance(k, str) and k.startswith("dmdask-block-"))


def _wait_forgotten(client, timeout: float = 10.0) -> None:
    """Until the scheduler has forgotten every block (the next part starts cold)."""
    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(_count_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)


def _goals(result: dict) -> List[dict]:
    goals = []
    for part, label in (("emulated", "emulated compute"), ("model", "real CNN")):
        r = result[part]
        ideal, mine, base = r["ideal"], r["dmdask"], r.get("baseline")
        later = ratio(mine["later_s"], ideal["later_s"])
        goals.append({"goal": f"dmdask epochs 2+ within 10% of the ideal, stall under 5% ({label})",
                      "met": later <= 1.10 and mine["later_stall"] < 0.05,
                      "measured": f"dmdask / ideal = {later:.2f}, stall {mine['later_stall']:.1%}"})
        if base is not None:
            first = ratio(mine["epoch1_s"], base["epoch1_s"])
            goals.append({"goal": f"dmdask epoch 1 no slower than the baseline ({label})",
                          "met": first <= 1.0,
                          "measured": f"dmdask / baseline (epoch 1) = {first:.2f}"})
    return goals


# -- the report ---------------------------------------------------------------------------------

def _table(result: dict, part: str) -> str:
    rows = result[part]
    ideal = rows["ideal"]
    lines = ["| loader | epoch 1 | epochs 2+ | epoch 1 / ideal | epochs 2+ / ideal | stall epoch 1 "
             "| stall epochs 2+ | of which starting the epoch (2+) | store: file bytes / D, metadata requests |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, label in LOADERS:
        r = rows.get(key)
        if r is None:
            continue
        if r.get("status", "ok") != "ok":
            lines.append(f"| {label} | not run: {r['reason']} | | | | | | | |")
            continue
        store = r.get("store")
        traffic = (f"{store['bytes'] / result['dataset_bytes']:.2f} D, {store['listings'] + store['heads']:,}"
                   if store else "none (in memory)")
        epochs = f"{len(r['epochs'])} epochs" if key == "ray" and len(r["epochs"]) != len(ideal["epochs"]) else ""
        lines.append(f"| {label}{' (' + epochs + ')' if epochs else ''} | {r['epoch1_s']:.2f} s | {r['later_s']:.2f} s "
                     f"| {ratio(r['epoch1_s'], ideal['epoch1_s']):.2f} | {ratio(r['later_s'], ideal['later_s']):.2f} "
                     f"| {r['stall1']:.1%} | {r['later_stall']:.1%} | {r['later_start_s']:.2f} s | {traffic} |")
    return "\n".join(lines)


def report(result: dict, plots_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    parts = [("emulated", f"emulated compute: {cfg['rate']:,} samples/s per rank, {cfg['world']} ranks"),
             ("model", f"real CNN: {cfg['model']['ranks']} rank, 1 torch thread")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, (part, title) in zip(axes, parts):
        rows = result[part]
        names = [(k, label) for k, label in LOADERS if k in rows and rows[k].get("status", "ok") == "ok"]
        x = np.arange(len(names))
        width = 0.38
        ax.bar(x - width / 2, [rows[k]["epoch1_s"] for k, _ in names], width, label="epoch 1")
        bars = ax.bar(x + width / 2, [rows[k]["later_s"] for k, _ in names], width, label="epochs 2+ (mean)")
        ax.bar(x + width / 2, [rows[k]["later_start_s"] for k, _ in names], width, fill=False, hatch="//",
               edgecolor="0.3", label="of which: starting the epoch's iterator")
        for b, (k, _) in zip(bars, names):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"stall\n{rows[k]['later_stall']:.0%}",
                    ha="center", va="bottom", fontsize=7)
        ax.axhline(rows["ideal"]["later_s"], color="k", ls="--", lw=1, label="ideal epoch")
        ax.axhline(result["store_floor_s"], color="tab:red", ls=":", lw=1, label="reading D once from the store")
        ax.set_xticks(x)
        ax.set_xticklabels([label.split(" (")[0].replace(" + ", "\n+ ") for _, label in names], fontsize=8)
        ax.set_ylabel("epoch wall time (s)")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{plots_dir}/training.png", dpi=110)
    plt.close(fig)
    mib = result["dataset_bytes"] / 2**20
    ray = result["emulated"].get("ray", {})
    ray_note = (f"Ray {ray.get('version')}: `ray.init(num_cpus={cfg['world']})` took {ray.get('init_s', 0):.0f} s "
                f"(not counted); building the dataset and its `streaming_split` took {ray.get('setup_s', 0):.1f} s "
                f"(a HEAD a file), counted in epoch 1 as waiting; {cfg['ray_epochs']} epochs. "
                if ray.get("status") == "ok" else f"Ray Data was not run: {ray.get('reason')}. ")
    return (
        f"{cfg['samples']:,} files of {cfg['sample_bytes']:,} B (D = {mib:.1f} MiB) on a store throttled to "
        f"{cfg['bandwidth'] / 2**20:.0f} MiB/s in all and {cfg['latency'] * 1e3:.0f} ms a request: reading "
        f"the dataset once takes at least {result['store_floor_s']:.1f} s, against "
        f"{result['compute_s']:.1f} s of emulated compute an epoch (a sleep of batch / "
        f"{cfg['rate']:,} samples/s after each batch of {cfg['batch']}, on each of {cfg['world']} trainer "
        f"ranks, threads started together each epoch). The real model is a 2-layer CNN on the bytes "
        f"decoded as a float image, one rank, one torch thread; on arrays in memory it trains at "
        f"{result['model_samples_per_s']:,.0f} samples/s. {cfg['epochs']} epochs (real model: "
        f"{cfg['model']['epochs']}). Ideal: the same loop over arrays already in the trainer's memory, "
        "split over the ranks as DistributedSampler does. Baseline: "
        f"DataLoader(num_workers={cfg['loader_workers']}, persistent_workers) + DistributedSampler per rank reading the store. dmdask: a 2-worker "
        f"LocalCluster whose RAM holds the dataset, blocks of {cfg['block']} files, exact global shuffle, "
        "default prefetch, cold at the start of each part. Ray Data: `read_binary_files` on the same URLs "
        "(through a pyarrow handler that reads a file with one GET), files reshuffled every epoch, "
        "`streaming_split(equal=True)`, `iter_torch_batches`. " + ray_note
        + "Stall = time the trainer waits for data (in `next()` and creating the epoch's iterator) / epoch "
        "time, averaged over the ranks; on two cores a loader also takes CPU from the trainer, so an epoch can "
        "exceed the ideal by more than its stall. Metadata requests: directory listings and HEADs sent to the store. "
        f"Whole scenario: {result['runtime_s']:.0f} s.\n\n"
        f"**Emulated compute** ({cfg['rate']:,} samples/s per rank)\n\n" + _table(result, "emulated")
        + "\n\n**Real CNN** (one rank)\n\n" + _table(result, "model")
        + "\n\n![training time](benchmarks/training.png)\n"
    )
