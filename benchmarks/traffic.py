"""Scenario 1: shared-store traffic, counted by the store, against the bound.

N nodes with one trainer rank each, E epochs, aggregate cache C = ratio x dataset D.
Loaders: PyTorch DataLoader + DistributedSampler on the store (baseline), the same with
a per-node cache and no sharing (Monarch), dmdask, and the bound E*D - min(C, D)*(E - 1).
"""
from __future__ import annotations

import threading

import distributed

import dmdask

from .baselines import NodeCachedFiles, StoreFiles, torch_epoch_loader
from .common import dataset_bytes, dmdask_cluster, run_ranks, served_bytes, workdir, write_files

PRESETS = {
    "tiny": {"samples": 120, "sample_bytes": 1024, "nodes": [2], "ratios": [0.5, 1.0], "epochs": 2, "block": 10},
    "quick": {"samples": 1200, "sample_bytes": 4096, "nodes": [2, 4], "ratios": [0.25, 0.5, 1.0, 2.0],
              "epochs": 5, "block": 25},
    "full": {"samples": 20000, "sample_bytes": 8192, "nodes": [2, 4], "ratios": [0.25, 0.5, 1.0, 2.0],
             "epochs": 5, "block": 100},
}
BATCH = 32


def run(preset: str) -> dict:
    from .store_server import StoreServer

    cfg = PRESETS[preset]
    rows = []
    with workdir("traffic") as root:
        paths = write_files(root + "/files", cfg["samples"], cfg["sample_bytes"])
        size = dataset_bytes(paths)
        with StoreServer(root) as store:
            urls = [store.url + "/files/" + p.split("/files/", 1)[1] for p in paths]
            for nodes in cfg["nodes"]:
                base = _torch_run(store, StoreFiles(urls), nodes, cfg["epochs"])
                for r in cfg["ratios"]:
                    capacity = int(r * size)
                    bound = cfg["epochs"] * size - min(capacity, size) * (cfg["epochs"] - 1)
                    caches = [NodeCachedFiles(urls, capacity // nodes) for _ in range(nodes)]
                    monarch = _torch_run(store, caches, nodes, cfg["epochs"])
                    mine = _dmdask_run(store, nodes, capacity, cfg)
                    rows.append({"nodes": nodes, "ratio": r, "capacity": capacity, "dataset": size,
                                 "epochs": cfg["epochs"], "bound": bound, "baseline": base,
                                 "monarch": monarch, "dmdask": mine})
    goals = [{
        "goal": "dmdask's shared-store bytes equal the bound within 2% at every point",
        "met": all(abs(r["dmdask"]["bytes"] / r["bound"] - 1) <= 0.02 for r in rows),
        "measured": "max |dmdask / bound - 1| = "
                    f"{max(abs(r['dmdask']['bytes'] / r['bound'] - 1) for r in rows):.2%}",
    }]
    return {"config": cfg, "rows": rows, "goals": goals}


def _torch_run(store, datasets, nodes: int, epochs: int) -> dict:
    """DataLoader + DistributedSampler ranks reading the store; `datasets` one per rank
    or one shared (a plain store reader)."""
    per_rank = datasets if isinstance(datasets, list) else [datasets] * nodes
    store.reset_stats()

    def rank(r):
        for epoch in range(epochs):
            for _ in torch_epoch_loader(per_rank[r], r, nodes, BATCH, epoch):
                pass

    run_ranks(nodes, rank)
    return served_bytes(store)


def _dmdask_run(store, nodes: int, capacity: int, cfg: dict) -> dict:
    # A sample in the cache costs its file plus 16 bytes (label, pointer); integer
    # arithmetic, so the workers hold exactly `capacity` bytes of files between them.
    per_worker = capacity * (cfg["sample_bytes"] + 16) // (nodes * cfg["sample_bytes"])
    with dmdask_cluster(nodes, ram=per_worker, stream_buffer=0) as cluster, distributed.Client(cluster) as client:
        store.reset_stats()
        spec = dmdask.Spec(store.url + "/files", batch_size=BATCH, block_size=cfg["block"])
        # ranks start each epoch together, as ranks that synchronise their gradients do: a rank
        # an epoch ahead could otherwise share the read of a sample not cached with the rank
        # behind (one read for two epochs), and the store would count less than the bound
        epoch_start = threading.Barrier(nodes)

        def rank(r):
            for epoch in range(cfg["epochs"]):
                epoch_start.wait(timeout=300)
                for _ in dmdask.batches(client, spec.replace(rank=r, world_size=nodes), epoch=epoch):
                    pass

        run_ranks(nodes, rank)
        out = served_bytes(store)
        dmdask.release(client, spec)
    return out


def report(result: dict, plots_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    lines = ["| nodes | cache / dataset | baseline (DataLoader) | per-node cache (Monarch) | dmdask | bound "
             "| dmdask / bound | dmdask vs baseline: fewer accesses (bytes / requests) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mib = r["dataset"] / 2**20
        lines.append(
            f"| {r['nodes']} | {r['ratio']:.2f} | {r['baseline']['bytes'] / 2**20 / mib:.2f} D "
            f"| {r['monarch']['bytes'] / 2**20 / mib:.2f} D | {r['dmdask']['bytes'] / 2**20 / mib:.2f} D "
            f"| {r['bound'] / 2**20 / mib:.2f} D | {r['dmdask']['bytes'] / r['bound']:.3f} "
            f"| {1 - r['dmdask']['bytes'] / r['baseline']['bytes']:.0%} / "
            f"{1 - r['dmdask']['requests'] / r['baseline']['requests']:.0%} |")
    fig, axes = plt.subplots(1, len({r["nodes"] for r in rows}), figsize=(11, 4), squeeze=False)
    for ax, nodes in zip(axes[0], sorted({r["nodes"] for r in rows})):
        sel = [r for r in rows if r["nodes"] == nodes]
        x = [r["ratio"] for r in sel]
        for key, label, style in [("baseline", "DataLoader (no cache)", "s-"),
                                  ("monarch", "per-node cache (Monarch)", "^-"),
                                  ("dmdask", "dmdask", "o-")]:
            ax.plot(x, [r[key]["bytes"] / r["dataset"] for r in sel], style, label=label)
        ax.plot(x, [r["bound"] / r["dataset"] for r in sel], "k--", label="bound E*D - min(C,D)*(E-1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("aggregate cache / dataset")
        ax.set_ylabel("shared-store bytes / dataset")
        ax.set_title(f"{nodes} nodes, {sel[0]['epochs']} epochs")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{plots_dir}/traffic.png", dpi=110)
    plt.close(fig)
    cfg = result["config"]
    return (f"{cfg['samples']} files of {cfg['sample_bytes']} B (D = {rows[0]['dataset'] / 2**20:.1f} MiB), "
            f"blocks of {cfg['block']} files, {cfg['epochs']} epochs, one rank per node, exact global "
            "shuffle. Bytes are the store server's own count of sample-file bytes sent.\n\n"
            + "\n".join(lines) + "\n\n![shared-store traffic](benchmarks/traffic.png)\n")
