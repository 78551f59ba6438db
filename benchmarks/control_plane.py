"""Scenario 4: the scale of the control plane.

Scheduler tasks and keys per epoch, requests from the trainer, and scheduler memory,
for datasets of tiny samples (so 10^6 samples fit here). A scheduler plugin counts the
tasks the scheduler runs; the trainer counts its requests to the workers.
"""
from __future__ import annotations

import distributed
import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin

import dmdask

from .common import dmdask_cluster, workdir

PRESETS = {
    "tiny": {"samples": [10_000], "chunk": 1000, "batch": 256, "epochs": 2},
    "quick": {"samples": [10_000, 100_000, 1_000_000], "chunk": 1000, "batch": 256, "epochs": 2},
    "full": {"samples": [10_000, 100_000, 1_000_000], "chunk": 1000, "batch": 256, "epochs": 3},
}


class TaskCounter(SchedulerPlugin):
    """Counts tasks that start running on the scheduler's workers."""

    name = "dmdask-bench-task-counter"

    def __init__(self):
        self.started = 0

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            self.started += 1


def _scheduler_numbers(dask_scheduler):
    import psutil

    plugin = dask_scheduler.plugins[TaskCounter.name]
    return {"tasks_run": plugin.started, "keys": len(dask_scheduler.tasks),
            "rss_mib": psutil.Process().memory_info().rss / 2**20}


def run(preset: str) -> dict:
    import zarr

    cfg = PRESETS[preset]
    rows = []
    with workdir("control") as root:
        for n in cfg["samples"]:
            path = f"{root}/n{n}.zarr"
            group = zarr.open_group(path, mode="w")
            group.create_array("x", shape=(n, 4), chunks=(cfg["chunk"], 4), dtype="float32")[:] = \
                np.zeros((n, 4), dtype="float32")
            with dmdask_cluster(2, ram="256 MiB", processes=True) as cluster, distributed.Client(cluster) as client:
                client.register_plugin(TaskCounter())
                before = client.run_on_scheduler(_scheduler_numbers)
                spec = dmdask.Spec(path, batch_size=cfg["batch"])
                epochs = []
                for epoch in range(cfg["epochs"]):
                    it = dmdask.batches(client, spec, epoch=epoch)
                    for _ in it:
                        pass
                    requests = it.requests
                    after = client.run_on_scheduler(_scheduler_numbers)
                    epochs.append({"epoch": epoch, "tasks": after["tasks_run"] - before["tasks_run"],
                                   "keys": after["keys"], "requests": requests,
                                   "scheduler_rss_mib": after["rss_mib"]})
                    before = after
                rows.append({"samples": n, "blocks": -(-n // cfg["chunk"]), "batches": len(it),
                             "epochs": epochs})
    worst = max(e["tasks"] / r["samples"] for r in rows for e in r["epochs"])
    goals = [{"goal": "scheduler tasks per epoch at most one per 100 samples",
              "met": worst <= 0.01, "measured": f"worst epoch: {worst * 100:.2f} tasks per 100 samples"}]
    return {"config": cfg, "rows": rows, "goals": goals}


def report(result: dict, plots_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    lines = ["| samples | blocks (keys) | batches | tasks epoch 1 | tasks epoch 2+ | tasks / 100 samples (worst) "
             "| requests to workers / epoch | scheduler RSS |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        later = max(e["tasks"] for e in r["epochs"][1:]) if len(r["epochs"]) > 1 else 0
        worst = max(e["tasks"] for e in r["epochs"]) / r["samples"] * 100
        lines.append(f"| {r['samples']:,} | {r['epochs'][-1]['keys']:,} | {r['batches']:,} "
                     f"| {r['epochs'][0]['tasks']:,} | {later:,} | {worst:.2f} | {r['epochs'][-1]['requests']:,} "
                     f"| {r['epochs'][-1]['scheduler_rss_mib']:.0f} MiB |")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = [r["samples"] for r in rows]
    ax.loglog(x, [r["epochs"][0]["tasks"] for r in rows], "o-", label="tasks, epoch 1 (one per block)")
    ax.loglog(x, [max(1, r["epochs"][-1]["requests"]) for r in rows], "s-", label="trainer requests per epoch")
    ax.loglog(x, [s / 100 for s in x], "k--", label="goal: 1 task per 100 samples")
    ax.set_xlabel("samples in the dataset")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{plots_dir}/control_plane.png", dpi=110)
    plt.close(fig)
    cfg = result["config"]
    return (f"Samples of 16 B in chunks of {cfg['chunk']}, batch {cfg['batch']}, one trainer. Tasks are counted "
            "by a scheduler plugin (transitions to processing); epochs after the first run no task at all: "
            "batches travel as RPCs between the trainer, its worker and the holders.\n\n"
            + "\n".join(lines) + "\n\n![control plane](benchmarks/control_plane.png)\n")
