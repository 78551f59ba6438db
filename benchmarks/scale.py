"""Scenario 6: the control plane at scale, on a stock cluster.

`dask scheduler` and two `dask worker --worker-class dmdask.Worker` processes, work
stealing on (Dask's default). Datasets are Zarr arrays of one-byte samples whose chunks
are never written (reads return the fill value), so 10^8 samples cost no disk.

- Planning, per rank: rank 1,023 of 1,024 starts in its own training process once the
  cluster holds the dataset, and reports the peak of the memory Python allocated
  (tracemalloc, from `dmdask.batches(...)` to its first batch) and the time to its
  first batch. The dataset has 1,000 blocks at every size, so the figures show how
  planning grows with samples alone.
- Block creation: the time from a rank's first `dmdask.batches` call until every block
  load is on the scheduler, pinned to its worker ("ready to load"), and the scheduler's
  RSS growth, at 10^3, 10^4 and 10^5 blocks.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from .common import scheduler_address

PRESETS = {
    "tiny": {"samples": [100_000], "blocks": [100], "probe_blocks": 100, "world": 1024, "batch": 256},
    "quick": {"samples": [10**6, 10**7, 10**8], "blocks": [10**3, 10**4, 10**5], "probe_blocks": 1000,
              "world": 1024, "batch": 256},
    "full": {"samples": [10**6, 10**7, 10**8], "blocks": [10**3, 10**4, 10**5], "probe_blocks": 1000,
             "world": 1024, "batch": 256},
}
GOAL_PEAK_MIB = 64
GOAL_FIRST_BATCH_S = 2.0
GOAL_CREATE_S = 30.0


def write_fill_array(path: str, n: int, chunk: int) -> str:
    """A Zarr array of n uint8 samples in chunks of `chunk`, no chunk written."""
    import zarr

    zarr.open_group(path, mode="w").create_array("x", shape=(n,), chunks=(chunk,), dtype="uint8", fill_value=0)
    return path


@contextlib.contextmanager
def stock_cluster(n_workers: int = 2, ram: str = "2 GiB"):
    """A scheduler and `n_workers` dmdask workers started with Dask's own CLI; yields
    (scheduler address, scheduler pid)."""
    folder = tempfile.mkdtemp(prefix="dmdask-bench-scale-")
    scheduler_file = os.path.join(folder, "scheduler.json")
    env = dict(os.environ, DASK_DMDASK__WORKER__RAM=ram)
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--port", "0",
                               "--dashboard-address", ":0", "--scheduler-file", scheduler_file],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        address = scheduler_address(scheduler_file)
        for _ in range(n_workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", address, "--worker-class", "dmdask.Worker",
                 "--nthreads", "1", "--no-nanny", "--local-directory", folder],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield address, procs[0].pid
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _rss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _wait_loaded(client, name: str, timeout: float = 600) -> bool:
    import dmdask

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in dmdask.stats(client)["datasets"]:
            if d["name"] == name and d["loaded"] == d["blocks"]:
                return True
        time.sleep(0.5)
    return False


def probe(address: str, path: str, rank: int, world: int, batch: int, trace: bool) -> dict:
    """In a fresh training process: from `batches()` to the first batch, the time
    (`trace=False`) or the peak of the memory Python allocated (`trace=True`: tracemalloc
    slows allocations down, so time and memory are measured in two processes)."""
    import tracemalloc

    import distributed
    import numpy as np

    import dmdask

    with distributed.Client(address) as client:
        spec = dmdask.Spec(path, batch_size=batch, rank=rank, world_size=world, seed=1)
        if trace:
            tracemalloc.start()
        started = time.perf_counter()
        it = dmdask.batches(client, spec, epoch=0, progress=False)
        first = next(it)
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1] if trace else 0
        tracemalloc.stop()
        it.close()
        ok = 0 < len(first["index"]) <= batch and bool(np.all(first["x"] == 0))
        if trace:
            return {"peak_mib": peak / 2**20, "batch_ok": ok}
        return {"first_batch_s": seconds, "batches": len(it), "batch_ok": ok}


def _run_probe(address: str, path: str, rank: int, world: int, batch: int) -> dict:
    """The time in one fresh process, the memory in another."""
    result = {}
    for trace in (False, True):
        out = subprocess.run([sys.executable, "-m", "benchmarks.scale", address, path, str(rank), str(world),
                              str(batch), str(int(trace))], capture_output=True, text=True, timeout=600,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if out.returncode:
            raise RuntimeError(f"probe failed: {out.stderr[-2000:]}")
        one = json.loads(out.stdout.strip().splitlines()[-1])
        result.update(one, batch_ok=result.get("batch_ok", True) and one["batch_ok"])
    return result


def run(preset: str) -> dict:
    import distributed

    import dmdask
    from dmdask.client.datasets import open_dataset

    cfg = PRESETS[preset]
    planning, creation = [], []
    with tempfile.TemporaryDirectory(prefix="dmdask-bench-scale-data-") as root, \
            stock_cluster() as (address, scheduler_pid), distributed.Client(address) as client:
        client.wait_for_workers(2, timeout=60)
        stealing = client.run_on_scheduler(lambda dask_scheduler: "stealing" in dask_scheduler.extensions)
        for n in cfg["samples"]:
            path = write_fill_array(os.path.join(root, f"n{n}.zarr"), n, chunk=-(-n // cfg["probe_blocks"]))
            spec = dmdask.Spec(path, batch_size=cfg["batch"], seed=1)
            info = open_dataset(client, spec, 0).info
            loaded = _wait_loaded(client, info.name)
            row = {"samples": n, "blocks": info.num_blocks, "loaded": loaded,
                   **_run_probe(address, path, cfg["world"] - 1, cfg["world"], cfg["batch"])}
            planning.append(row)
            dmdask.release(client, spec)
            print(f"[scale] planning n={n}: {row}", flush=True)
        for blocks in cfg["blocks"]:
            n = blocks * 10
            path = write_fill_array(os.path.join(root, f"b{blocks}.zarr"), n, chunk=10)
            spec = dmdask.Spec(path, batch_size=cfg["batch"], seed=1)
            rss_before = _rss_mib(scheduler_pid)
            started = time.perf_counter()
            info = open_dataset(client, spec, 0).info
            seconds = time.perf_counter() - started
            rss_after = _rss_mib(scheduler_pid)
            row = {"blocks": info.num_blocks, "ready_s": seconds, "scheduler_rss_before_mib": rss_before,
                   "scheduler_rss_after_mib": rss_after,
                   "scheduler_kib_per_block": (rss_after - rss_before) * 1024 / blocks}
            creation.append(row)
            dmdask.release(client, spec)
            print(f"[scale] creation {blocks} blocks: {row}", flush=True)
            time.sleep(1)
    biggest = planning[-1]
    largest = creation[-1]
    goals = [
        {"goal": f"a rank of {cfg['world']:,} at {biggest['samples']:,} samples allocates < {GOAL_PEAK_MIB} MiB "
                 "before its first batch", "met": biggest["peak_mib"] < GOAL_PEAK_MIB,
         "measured": f"{biggest['peak_mib']:.1f} MiB"},
        {"goal": f"... and gets its first batch in < {GOAL_FIRST_BATCH_S:.0f} s",
         "met": biggest["first_batch_s"] < GOAL_FIRST_BATCH_S, "measured": f"{biggest['first_batch_s']:.2f} s"},
        {"goal": f"{largest['blocks']:,} blocks ready to load in < {GOAL_CREATE_S:.0f} s",
         "met": largest["ready_s"] < GOAL_CREATE_S, "measured": f"{largest['ready_s']:.1f} s"},
    ]
    return {"config": cfg, "work_stealing": stealing, "planning": planning, "creation": creation, "goals": goals}


def report(result: dict, plots_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    lines = [f"Rank {cfg['world'] - 1:,} of {cfg['world']:,}, batch {cfg['batch']}, in its own process, once the "
             f"cluster holds the dataset ({cfg['probe_blocks']:,} blocks at every size). Stock `dask scheduler` "
             f"(work stealing {'on' if result['work_stealing'] else 'off'}) and two `dask worker --worker-class "
             "dmdask.Worker`.", "",
             "| samples | blocks | peak allocated before the first batch (tracemalloc) | time to the first batch |",
             "|---:|---:|---:|---:|"]
    for r in result["planning"]:
        lines.append(f"| {r['samples']:,} | {r['blocks']:,} | {r['peak_mib']:.1f} MiB | {r['first_batch_s']:.2f} s |")
    lines += ["", "Block creation: from a rank's first `dmdask.batches` call until every block load is on the "
              "scheduler, pinned to its worker.", "",
              "| blocks | ready to load | scheduler RSS before | after | per block |", "|---:|---:|---:|---:|---:|"]
    for r in result["creation"]:
        lines.append(f"| {r['blocks']:,} | {r['ready_s']:.2f} s | {r['scheduler_rss_before_mib']:.0f} MiB "
                     f"| {r['scheduler_rss_after_mib']:.0f} MiB | {r['scheduler_kib_per_block']:.1f} KiB |")
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.semilogx([r["samples"] for r in result["planning"]], [r["peak_mib"] for r in result["planning"]], "o-",
               label="peak allocated (MiB)")
    a.semilogx([r["samples"] for r in result["planning"]], [r["first_batch_s"] for r in result["planning"]], "s-",
               label="time to first batch (s)")
    a.axhline(GOAL_PEAK_MIB, color="k", ls="--", lw=0.8, label=f"goal {GOAL_PEAK_MIB} MiB")
    a.set_xlabel("samples")
    a.set_yscale("symlog")
    a.legend(fontsize=7)
    b.loglog([r["blocks"] for r in result["creation"]], [r["ready_s"] for r in result["creation"]], "o-",
             label="ready to load (s)")
    b.axhline(GOAL_CREATE_S, color="k", ls="--", lw=0.8, label=f"goal {GOAL_CREATE_S:.0f} s")
    b.set_xlabel("blocks")
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{plots_dir}/scale.png", dpi=110)
    plt.close(fig)
    return "\n".join(lines) + "\n\n![scale](benchmarks/scale.png)\n"


if __name__ == "__main__":
    address, path, rank, world, batch, trace = sys.argv[1:7]
    print(json.dumps(probe(address, path, int(rank), int(world), int(batch), trace == "1")))
