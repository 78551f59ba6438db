"""Scenario 7: transparent mode, an unmodified PyTorch pipeline through `dmdask::`.

One ImageFolder-like Dataset over fsspec (class folders of files; an item is a file's
bytes), a DataLoader with shuffling and 2 loader worker processes (PyTorch's defaults
otherwise: workers made anew each epoch), and nothing else: no compute. The same
pipeline reads
- local: the files on this machine's disk (plain paths),
- store: the files on a throttled `StoreServer` (HTTP, a per-request latency and a
  bandwidth cap: the stand-in for a contended shared file system),
- dmdask: the same URLs with `dmdask::` in front, through a 2-worker `LocalCluster`
  whose cache holds the dataset.
- the same pipelines with `persistent_workers=True` (store and dmdask::, on a cold
  copy of the files),
- mount: the same Dataset over plain paths of a `dmdask mount` of the store folder (a
  cold copy), when FUSE is available (torchvision's own ImageFolder is not installed
  here; this Dataset lists and reads as it does, minus decoding).
Reported: epoch 1 and epochs 2+ wall times, the bytes and requests (GETs, HEADs) the
store received, and the goals of issue #20 as ratios. Then the loaders of `benchmarks.loaders`
over a folder of JPEGs (DataLoader with 4 non-persistent workers, torchdata's
StatefulDataLoader, tf.data over the mount) and the goals of issue #38.
Alone: `python -m benchmarks run --quick --only transparent`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import distributed
import fsspec

from dmdask.testing.mount import unmount

from . import loaders
from .common import dataset_bytes, dmdask_cluster, served_bytes, workdir, write_files

PRESETS = {
    "tiny": {"samples": 120, "sample_bytes": 4096, "epochs": 2, "latency": 0.0, "bandwidth": None, "batch": 16,
             "jpegs": 120, "jpeg_side": 64},
    "quick": {"samples": 2048, "sample_bytes": 16384, "epochs": 3, "latency": 0.002, "bandwidth": 16 * 2**20,
              "batch": 32, "jpegs": 2000, "jpeg_side": 160},
    "full": {"samples": 8192, "sample_bytes": 65536, "epochs": 3, "latency": 0.002, "bandwidth": 32 * 2**20,
             "batch": 64, "jpegs": 8000, "jpeg_side": 224},
}
PIPELINES = [("local", "local disk"), ("store", "the store directly"), ("dmdask", "dmdask:: (the cluster's cache)"),
             ("store_persistent", "the store directly, persistent workers"),
             ("dmdask_persistent", "dmdask::, persistent workers"), ("mount", "dmdask mount (plain paths)")]
MOUNT_SECONDS = 60  # the most the mount may take to appear
LOADER_WORKERS = 2


class FolderFiles:
    """torchvision's ImageFolder, over any fsspec URL, minus decoding: (bytes, class),
    listed as `loaders.class_files` lists."""

    def __init__(self, root: str):
        self.items = loaders.class_files(root)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        url, label = self.items[i]
        with fsspec.open(url, "rb") as f:
            return f.read(), label


def keep(items):
    return items


def _epochs(root: str, cfg: dict, persistent: bool = False) -> dict:
    """Wall time of each epoch of the pipeline over `root`, and the samples it gave."""
    import torch.utils.data

    started = time.perf_counter()
    dataset = FolderFiles(root)
    listed = time.perf_counter() - started
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg["batch"], shuffle=True, num_workers=LOADER_WORKERS,
                                         collate_fn=keep, persistent_workers=persistent)
    times, samples = [], 0
    for _ in range(cfg["epochs"]):
        started = time.perf_counter()
        for batch in loader:
            samples += len(batch)
        times.append(time.perf_counter() - started)
    later = times[1:] or times
    return {"list_s": listed, "epochs_s": times, "epoch1_s": times[0], "later_s": sum(later) / len(later),
            "samples": samples, "samples_per_s_later": len(dataset) / (sum(later) / len(later))}


def _fuse_missing():
    """Why a FUSE mount cannot be made here, or None."""
    if not os.path.exists("/dev/fuse") or not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "no /dev/fuse or fusermount"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"no mfusepy or libfuse: {exc}"
    return None


def _mounted(url: str, mountpoint: str, scheduler: str):
    """A `dmdask mount` process serving `url` at `mountpoint` (None when it did not appear)."""
    proc = subprocess.Popen([sys.executable, "-m", "dmdask.cli", "mount", url, mountpoint, "--scheduler", scheduler],
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + MOUNT_SECONDS
    while not os.path.ismount(mountpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            unmount(proc, mountpoint)
            return None
        time.sleep(0.2)
    return proc


def _store_counts(store) -> dict:
    counts = served_bytes(store)
    counts["head_requests"] = store.stats()["head_requests"]
    return counts


def run(preset: str) -> dict:
    from .store_server import StoreServer

    cfg = PRESETS[preset]
    rows = {}
    with workdir("transparent") as root:
        paths = write_files(root + "/files", cfg["samples"], cfg["sample_bytes"])
        for copy in ("files_p", "files_m"):  # cold copies for the persistent-worker and mount pipelines
            shutil.copytree(root + "/files", f"{root}/{copy}")
        size = dataset_bytes(paths)
        rows["local"] = _epochs(root + "/files", cfg)
        with StoreServer(root, latency=cfg["latency"], bandwidth=cfg["bandwidth"]) as store:
            for key, folder, persistent in [("store", "files", False), ("store_persistent", "files_p", True)]:
                store.reset_stats()
                rows[key] = _epochs(f"{store.url}/{folder}", cfg, persistent)
                rows[key]["store"] = _store_counts(store)
            with dmdask_cluster(2, ram=4 * size + (64 << 20)) as cluster, distributed.Client(cluster):
                for key, folder, persistent in [("dmdask", "files", False), ("dmdask_persistent", "files_p", True)]:
                    store.reset_stats()
                    rows[key] = _epochs(f"dmdask::{store.url}/{folder}", cfg, persistent)
                    rows[key]["store"] = _store_counts(store)
                mountpoint = root + "/mnt"
                os.mkdir(mountpoint)
                proc = None if _fuse_missing() else _mounted(f"{store.url}/files_m", mountpoint,
                                                              cluster.scheduler_address)
                if proc is not None:
                    try:
                        store.reset_stats()
                        rows["mount"] = _epochs(mountpoint, cfg)
                        rows["mount"]["store"] = _store_counts(store)
                    finally:
                        unmount(proc, mountpoint)
                jpegs = loaders.run(cfg, root, store, cluster, lambda *a: None if _fuse_missing() else _mounted(*a))
    return {"config": cfg, "dataset": size, "rows": rows, "jpegs": jpegs,
            "goals": goals_of(rows, cfg, size) + loaders.goals_of(jpegs, cfg["epochs"])}


def goals_of(rows: dict, cfg: dict, size: int) -> list:
    """The goals of the scenario (issue #20), each met or not, with what was measured."""
    expected = cfg["samples"] * cfg["epochs"]
    files = cfg["samples"]

    def ratio(a, b, key):
        return rows[a][key] / rows[b][key]

    goals = [
        {"goal": "every pipeline delivers every sample each epoch",
         "met": all(r["samples"] == expected for r in rows.values()),
         "measured": ", ".join(f"{k}: {r['samples']}/{expected}" for k, r in rows.items())},
        {"goal": "dmdask:: reads each byte from the store once over all epochs",
         "met": rows["dmdask"]["store"]["bytes"] == size,
         "measured": f"{rows['dmdask']['store']['bytes'] / size:.2f} D (the store directly: "
                     f"{rows['store']['store']['bytes'] / size:.2f} D)"},
        {"goal": "dmdask:: epochs 2+ faster than reading the store directly",
         "met": rows["dmdask"]["later_s"] < rows["store"]["later_s"],
         "measured": f"{rows['dmdask']['later_s']:.2f} s vs {rows['store']['later_s']:.2f} s "
                     f"(local disk {rows['local']['later_s']:.2f} s)"},
    ]
    for key, store, workers in [("dmdask", "store", "non-persistent"), ("dmdask_persistent", "store_persistent",
                                                                         "persistent")]:
        first, later = ratio(key, store, "epoch1_s"), ratio(key, store, "later_s")
        counts = rows[key]["store"]
        goals += [
            {"goal": f"#20: dmdask:: epoch 1 <= 1.1x the direct read ({workers} workers)", "met": first <= 1.1,
             "measured": f"{first:.2f}x ({rows[key]['epoch1_s']:.2f} s vs {rows[store]['epoch1_s']:.2f} s)"},
            {"goal": f"#20: dmdask:: epochs 2+ <= 0.5x the direct read ({workers} workers)", "met": later <= 0.5,
             "measured": f"{later:.2f}x ({rows[key]['later_s']:.2f} s vs {rows[store]['later_s']:.2f} s)"},
            {"goal": f"#20: at most one store request per file over the run, each byte once ({workers} workers)",
             "met": counts["requests"] + counts["head_requests"] <= files and counts["bytes"] == size,
             "measured": f"{counts['requests']} GETs + {counts['head_requests']} HEADs for {files} files, "
                         f"{counts['bytes'] / size:.2f} D"},
        ]
    if "mount" in rows:
        first, later = ratio("mount", "store", "epoch1_s"), ratio("mount", "local", "later_s")
        goals += [
            {"goal": "#20: the mount's epoch 1 <= 1.3x the same reader over the store directly", "met": first <= 1.3,
             "measured": f"{first:.2f}x ({rows['mount']['epoch1_s']:.2f} s vs {rows['store']['epoch1_s']:.2f} s)"},
            {"goal": "#20: the mount's epochs 2+ <= 2x the same reader on local disk", "met": later <= 2.0,
             "measured": f"{later:.2f}x ({rows['mount']['later_s']:.2f} s vs {rows['local']['later_s']:.2f} s)"},
        ]
    else:
        goals.append({"goal": "#20: the mount's goals", "met": False, "measured": "not run: " + str(_fuse_missing())})
    return goals


def report(result: dict, plots_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, rows, size = result["config"], result["rows"], result["dataset"]
    lines = ["| pipeline | listing (s) | epoch 1 (s) | epochs 2+ (s, mean) | samples/s, epochs 2+ | store bytes "
             "| file GETs + all HEADs |", "|---|---:|---:|---:|---:|---:|---:|"]
    shown = [(key, label) for key, label in PIPELINES if key in rows]
    for key, label in shown:
        r = rows[key]
        store = f"{r['store']['bytes'] / size:.2f} D" if "store" in r else "-"
        asked = f"{r['store']['requests']} + {r['store'].get('head_requests', 0)}" if "store" in r else "-"
        lines.append(f"| {label} | {r['list_s']:.2f} | {r['epoch1_s']:.2f} | {r['later_s']:.2f} "
                     f"| {r['samples_per_s_later']:,.0f} | {store} | {asked} |")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = range(len(shown))
    ax.bar([i - 0.2 for i in x], [rows[k]["epoch1_s"] for k, _ in shown], 0.4, label="epoch 1")
    ax.bar([i + 0.2 for i in x], [rows[k]["later_s"] for k, _ in shown], 0.4, label="epochs 2+ (mean)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([label for _, label in shown], fontsize=6, rotation=15)
    ax.set_ylabel("epoch wall time (s)")
    ax.set_title(f"DataLoader({LOADER_WORKERS} workers), no compute", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{plots_dir}/transparent.png", dpi=110)
    plt.close(fig)
    bandwidth = f"{cfg['bandwidth'] / 2**20:.0f} MiB/s" if cfg["bandwidth"] else "no cap"
    return (f"{cfg['samples']} files of {cfg['sample_bytes']} B (D = {size / 2**20:.1f} MiB) in 10 class folders, "
            f"{cfg['epochs']} epochs, batch {cfg['batch']}, shuffled; store latency {cfg['latency'] * 1000:.0f} ms a "
            f"request, {bandwidth}. The pipeline is the same for all; only the root changes. Loader "
            "worker processes are made anew each epoch (PyTorch's default) unless the row says persistent, so "
            "each makes its own cluster connection and asks the scheduler where its files are. The persistent "
            "and mount rows read cold copies of the files. HEADs are the store's count over the whole pipeline "
            "(listings included).\n\n"
            + "\n".join(lines) + "\n\n![transparent mode](benchmarks/transparent.png)\n" + _jpeg_section(result))


def _jpeg_section(result: dict) -> str:
    jpegs = result.get("jpegs")
    if not jpegs:
        return ""
    cfg = result["config"]
    return (f"\n**The loaders people run, over a folder of JPEGs** (`benchmarks/loaders.py`, issue #38): "
            f"{jpegs['files']} JPEGs of {cfg['jpeg_side']}x{cfg['jpeg_side']} (D = {jpegs['dataset'] / 2**20:.1f} MiB) "
            f"in 10 class folders, {cfg['epochs']} epochs, the same throttled store; each item read and decoded "
            f"(Pillow; tf.io.decode_jpeg for tf.data). PyTorch's loaders: {loaders.LOADER_WORKERS} worker processes "
            "made anew each epoch. Every dmdask row reads a cold copy. The load average is the machine's, "
            "at the row's start and end.\n\n" + loaders.table(jpegs, cfg["epochs"]))
