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
Reported: epoch 1 and epochs 2+ wall times, and the bytes the store sent.
Alone: `python -m benchmarks run --quick --only transparent`.
"""
from __future__ import annotations

import time

import distributed
import fsspec

from .common import dataset_bytes, dmdask_cluster, served_bytes, workdir, write_files

PRESETS = {
    "tiny": {"samples": 120, "sample_bytes": 4096, "epochs": 2, "latency": 0.0, "bandwidth": None, "batch": 16},
    "quick": {"samples": 2048, "sample_bytes": 16384, "epochs": 3, "latency": 0.002, "bandwidth": 16 * 2**20,
              "batch": 32},
    "full": {"samples": 8192, "sample_bytes": 65536, "epochs": 3, "latency": 0.002, "bandwidth": 32 * 2**20,
             "batch": 64},
}
PIPELINES = [("local", "local disk"), ("store", "the store directly"), ("dmdask", "dmdask:: (the cluster's cache)")]
LOADER_WORKERS = 2


class FolderFiles:
    """torchvision's ImageFolder, over any fsspec URL, minus decoding: (bytes, class)."""

    def __init__(self, root: str):
        fs, path = fsspec.core.url_to_fs(root)
        prefix = root.split("::", 1)[0] + "::" if "::" in root else ""
        classes = sorted(e["name"] for e in fs.ls(path, detail=True) if e["type"] == "directory")
        self.items = [(prefix + name, label) for label, folder in enumerate(classes)
                      for name in sorted(e["name"] for e in fs.ls(folder, detail=True) if e["type"] == "file")]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        url, label = self.items[i]
        with fsspec.open(url, "rb") as f:
            return f.read(), label


def keep(items):
    return items


def _epochs(root: str, cfg: dict) -> dict:
    """Wall time of each epoch of the pipeline over `root`, and the samples it gave."""
    import torch.utils.data

    started = time.perf_counter()
    dataset = FolderFiles(root)
    listed = time.perf_counter() - started
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg["batch"], shuffle=True, num_workers=LOADER_WORKERS,
                                         collate_fn=keep)
    times, samples = [], 0
    for _ in range(cfg["epochs"]):
        started = time.perf_counter()
        for batch in loader:
            samples += len(batch)
        times.append(time.perf_counter() - started)
    later = times[1:] or times
    return {"list_s": listed, "epochs_s": times, "epoch1_s": times[0], "later_s": sum(later) / len(later),
            "samples": samples, "samples_per_s_later": len(dataset) / (sum(later) / len(later))}


def run(preset: str) -> dict:
    from .store_server import StoreServer

    cfg = PRESETS[preset]
    rows = {}
    with workdir("transparent") as root:
        paths = write_files(root + "/files", cfg["samples"], cfg["sample_bytes"])
        size = dataset_bytes(paths)
        rows["local"] = _epochs(root + "/files", cfg)
        with StoreServer(root, latency=cfg["latency"], bandwidth=cfg["bandwidth"]) as store:
            store.reset_stats()
            rows["store"] = _epochs(store.url + "/files", cfg)
            rows["store"]["store"] = served_bytes(store)
            with dmdask_cluster(2, ram=2 * size + (64 << 20)) as cluster, distributed.Client(cluster):
                store.reset_stats()
                rows["dmdask"] = _epochs("dmdask::" + store.url + "/files", cfg)
                rows["dmdask"]["store"] = served_bytes(store)
    expected = cfg["samples"] * cfg["epochs"]
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
    return {"config": cfg, "dataset": size, "rows": rows, "goals": goals}


def report(result: dict, plots_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, rows, size = result["config"], result["rows"], result["dataset"]
    lines = ["| pipeline | listing (s) | epoch 1 (s) | epochs 2+ (s, mean) | samples/s, epochs 2+ | store bytes |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, label in PIPELINES:
        r = rows[key]
        store = f"{r['store']['bytes'] / size:.2f} D" if "store" in r else "-"
        lines.append(f"| {label} | {r['list_s']:.2f} | {r['epoch1_s']:.2f} | {r['later_s']:.2f} "
                     f"| {r['samples_per_s_later']:,.0f} | {store} |")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = range(len(PIPELINES))
    ax.bar([i - 0.2 for i in x], [rows[k]["epoch1_s"] for k, _ in PIPELINES], 0.4, label="epoch 1")
    ax.bar([i + 0.2 for i in x], [rows[k]["later_s"] for k, _ in PIPELINES], 0.4, label="epochs 2+ (mean)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([label for _, label in PIPELINES], fontsize=8)
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
            f"request, {bandwidth}. The pipeline is the same for all three; only the root URL changes. Loader "
            "worker processes are made anew each epoch (PyTorch's default), so each makes its own cluster "
            "connection and asks the scheduler where its files are.\n\n"
            + "\n".join(lines) + "\n\n![transparent mode](benchmarks/transparent.png)\n")
