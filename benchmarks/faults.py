"""Scenario 13: epochs under the faults production clusters have (issue 37).

A stock `dask scheduler` (dmdask preloaded), three `dask worker --worker-class
dmdask.Worker --no-nanny` and two rank processes (`dmdask.testing.rank_process`, each
checking every batch's values), all on this machine; the ranks count as another node
(`dmdask.client.host` = 127.0.0.9), so no row is mapped: each crosses a worker's row
channel, as for ranks on other nodes. The dataset: a Zarr v3 group (uncompressed) served
over HTTP by a `benchmarks.store_server` process with a per-request latency.

Each configuration runs on a fresh cluster and store: a cold epoch (every block read from
the store), then a warm one. Faults:

- paused worker: one worker (a different one each epoch) is SIGSTOPped once every rank
  has its first batches, and continued (SIGCONT) after twice the ranks' reply deadline
  (half `dmdask.client.recovery-seconds`), unless the epoch ended first;
- flaky store: the store answers 503 to every 20th GET (5%) and holds every 100th (1%)
  for 60 s, longer than `dmdask.store.read-seconds`, which cuts it.

Recorded per epoch: its time (the slower rank's, from creating its iterator to its last
batch), the bytes the store sent for chunks (x the dataset), whether every sample came
exactly once (asserted: a scenario that loses or repeats one fails), and whether a paused
worker was still stopped when the epoch ended (the deadlines, not the worker resuming,
ended the wait). Settings (all processes): see `SETTINGS`.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from .common import ratio, workdir
from .store_server import StoreProcess

PRESETS = {
    "tiny": {"samples": 1200, "floats": 64, "chunk": 50, "batch": 50, "step": 0.02, "latency": 0.005,
             "recovery": 16, "silent": 5, "read_seconds": 2, "configs": ["none", "paused+flaky"]},
    # quick and full: dmdask's default deadlines (recovery 60 s, silent 15 s, read 10 s: at the earlier default
    # read-seconds = retry-seconds = 30 s, a hung request failed its block, BlockReadError "after 1 tries in 30.0 s")
    "quick": {"samples": 24000, "floats": 1024, "chunk": 400, "batch": 200, "step": 0.02, "latency": 0.01,
              "recovery": 60, "silent": 15, "read_seconds": 10,
              "configs": ["none", "paused", "flaky", "paused+flaky"]},
    "full": {"samples": 96000, "floats": 1024, "chunk": 800, "batch": 400, "step": 0.02, "latency": 0.01,
             "recovery": 60, "silent": 15, "read_seconds": 10,
             "configs": ["none", "paused", "flaky", "paused+flaky"]},
}
RANKS, WORKERS = 2, 3
FAIL_EVERY, HANG_EVERY, HANG_SECONDS = 20, 100, 60.0
ELSEWHERE = "127.0.0.9"  # the ranks' host: one with no worker


def run(preset: str) -> dict:
    cfg = dict(PRESETS[preset])
    with workdir("faults") as root:
        from dmdask.testing.datasets import write_zarr

        write_zarr(os.path.join(root, "d.zarr"), cfg["samples"], sample_shape=(cfg["floats"],), chunk=cfg["chunk"],
                   compressed=False)
        dataset = cfg["samples"] * (cfg["floats"] * 4 + 8)  # "x" float32 and "label" int64
        rows = [_configuration(root, cfg, name) for name in cfg["configs"]]
    result = {"config": cfg, "dataset_bytes": dataset, "rows": rows}
    for row in rows:
        for epoch in row["epochs"]:
            epoch["store_d"] = epoch["store_bytes"] / dataset
    base = {e["kind"]: e["seconds"] for e in rows[0]["epochs"]}
    for row in rows:
        for epoch in row["epochs"]:
            epoch["vs_none"] = ratio(epoch["seconds"], base[epoch["kind"]])
    result["goals"] = goals(result)
    return result


def settings(cfg) -> dict:
    return {"DASK_DMDASK__CLIENT__RECOVERY_SECONDS": str(cfg["recovery"]),
            "DASK_DMDASK__WORKER__SILENT_SECONDS": str(cfg["silent"]),
            "DASK_DMDASK__STORE__READ_SECONDS": str(cfg["read_seconds"]),
            "DASK_DMDASK__WORKER__RAM": "1 GiB", "DASK_DMDASK__WORKER__SSD": "0",
            "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "300s"}  # Dask's own default: it ends no wait here


def deadline(cfg) -> float:
    """The ranks' reply deadline: half `dmdask.client.recovery-seconds` (`dmdask.recovery.reply_seconds`)."""
    return cfg["recovery"] / 2


def _configuration(root: str, cfg, name: str) -> dict:
    paused, flaky = "paused" in name, "flaky" in name
    store_args = ["--latency", cfg["latency"]]
    if flaky:
        store_args += ["--fail-every", FAIL_EVERY, "--hang-every", HANG_EVERY, "--hang-seconds", HANG_SECONDS]
    env = dict(os.environ, **settings(cfg))
    with StoreProcess("benchmarks.store_server:main", root, *store_args) as store, _Cluster(root, env) as cluster:
        epochs = []
        for epoch, kind in enumerate(("cold", "warm")):
            store.reset_stats()
            victim = cluster.pids[sorted(cluster.pids)[epoch]] if paused else None
            epochs.append(dict(_epoch(root, cfg, env, cluster.address, store.url + "/d.zarr", epoch, victim),
                               kind=kind, **_chunks(store.stats())))
    return {"name": name, "paused": paused, "flaky": flaky, "epochs": epochs}


def _chunks(stats: dict) -> dict:
    chosen = [v for p, v in stats["by_path"].items() if "/c/" in p]
    return {"store_bytes": sum(v["bytes"] for v in chosen), "store_gets": sum(v["requests"] for v in chosen),
            "failed": stats.get("failed", 0), "hung": stats.get("hung", 0)}


def _epoch(root: str, cfg, env: dict, address: str, source: str, epoch: int, victim: int | None) -> dict:
    out = os.path.join(root, f"epoch-{epoch}-{time.monotonic_ns()}")
    os.makedirs(out)
    rank_env = dict(env, DASK_DMDASK__CLIENT__HOST=ELSEWHERE)
    ranks = [subprocess.Popen([sys.executable, "-m", "dmdask.testing.rank_process", address, source, str(r),
                               str(RANKS), str(epoch), str(cfg["batch"]), str(cfg["step"]), f"{out}/rank-{r}.npy"],
                              env=rank_env, stderr=subprocess.PIPE, text=True) for r in range(RANKS)]
    stopped_at = None
    try:
        if victim is not None:
            _wait(lambda: all(_delivered(out, r) >= 2 for r in range(RANKS))
                  or any(p.poll() is not None for p in ranks), 300, "every rank has its first batches")
            os.kill(victim, signal.SIGSTOP)
            stopped_at = time.monotonic()
        while any(p.poll() is None for p in ranks):
            if stopped_at is not None and time.monotonic() - stopped_at > 2 * deadline(cfg):
                os.kill(victim, signal.SIGCONT)  # paused for twice the deadline
                stopped_at = None
            time.sleep(0.05)
        still_stopped = stopped_at is not None
    finally:
        if stopped_at is not None:
            os.kill(victim, signal.SIGCONT)
        for p in ranks:
            if p.poll() is None:
                p.kill()
    errors = [p.stderr.read()[-2000:] for p in ranks if p.wait() != 0]
    if errors:
        raise RuntimeError(f"a rank failed in epoch {epoch}: {errors[0]}")
    ids = np.concatenate([np.load(f"{out}/rank-{r}.npy") for r in range(RANKS)])
    exactly_once = len(ids) == cfg["samples"] and np.array_equal(np.sort(ids), np.arange(cfg["samples"]))
    if not exactly_once:
        raise AssertionError(f"epoch {epoch} delivered {len(ids)} ids, {len(np.unique(ids))} distinct, of "
                             f"{cfg['samples']}: not every sample exactly once")
    seconds = max(float(open(f"{out}/rank-{r}.npy.seconds").read()) for r in range(RANKS))
    return {"seconds": seconds, "exactly_once": exactly_once, "paused_until_the_end": still_stopped,
            "load_1min": round(os.getloadavg()[0], 2)}


def _delivered(out: str, rank: int) -> int:
    try:
        with open(f"{out}/rank-{rank}.npy.count") as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _wait(condition, seconds: float, what: str) -> None:
    limit = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > limit:
            raise TimeoutError(f"not within {seconds} s: {what}")
        time.sleep(0.05)


class _Cluster:
    """A stock scheduler and `WORKERS` dmdask workers without nannies, on 127.0.0.1."""

    def __init__(self, root: str, env: dict):
        self.root, self.env, self.procs = root, env, []

    def __enter__(self):
        import distributed

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{port}"
        self.logs = [os.path.join(self.root, f"{name}-{port}.log") for name in ["scheduler"] + [
            f"worker-{i}" for i in range(WORKERS)]]

        def log(i: int) -> dict:
            return {"stdout": subprocess.DEVNULL, "stderr": open(self.logs[i], "wb"), "env": self.env}

        try:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
                 "--no-dashboard", "--preload", "dmdask"], **log(0)))
            for i in range(WORKERS):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "distributed.cli.dask_worker", self.address, "--worker-class",
                     "dmdask.Worker", "--nthreads", "1", "--host", "127.0.0.1", "--no-nanny", "--no-dashboard",
                     "--local-directory", os.path.join(self.root, f"w{i}-{port}")], **log(i + 1)))
            with distributed.Client(self.address, timeout=60) as client:
                client.wait_for_workers(WORKERS, timeout=120)
                self.pids = client.run(os.getpid)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if exc and isinstance(exc[1], Exception):  # what the cluster's processes said, with the error
            for path in self.logs:
                with open(path, "rb") as f:
                    exc[1].add_note(f"--- {os.path.basename(path)} (its last 3,000 characters):\n"
                                    + f.read()[-3000:].decode(errors="replace"))
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
        for p in self.procs:
            p.wait(30)


def goals(result: dict) -> list:
    epochs = [e for row in result["rows"] for e in row["epochs"]]
    paused = [e for row in result["rows"] if row["paused"] for e in row["epochs"]]
    return [
        {"goal": "every sample exactly once in every epoch, under every fault", "met": all(e["exactly_once"]
                                                                                         for e in epochs),
         "measured": f"{sum(e['exactly_once'] for e in epochs)} of {len(epochs)} epochs"},
        {"goal": "an epoch with a paused worker ends before the worker resumes (bounded by the deadlines)",
         "met": all(e["paused_until_the_end"] for e in paused),
         "measured": f"{sum(e['paused_until_the_end'] for e in paused)} of {len(paused)} epochs"},
    ]


def table(result: dict) -> str:
    lines = ["| faults | epoch | seconds | / no faults | store bytes (x dataset) | chunk GETs | 503s | hung | "
             "worker still paused at the end | exactly once |", "|---|---|--:|--:|--:|--:|--:|--:|:-:|:-:|"]
    for row in result["rows"]:
        for e in row["epochs"]:
            paused = ("yes" if e["paused_until_the_end"] else "no") if row["paused"] else "-"
            lines.append(f"| {row['name']} | {e['kind']} | {e['seconds']:.1f} | {e['vs_none']:.2f}x | "
                         f"{e['store_d']:.2f} | {e['store_gets']} | {e['failed']} | {e['hung']} | {paused} | "
                         f"{'yes' if e['exactly_once'] else '**no**'} |")
    return "\n".join(lines)


def report(result: dict, plots_dir: str) -> str:
    cfg = result["config"]
    loads = [e["load_1min"] for row in result["rows"] for e in row["epochs"]]
    text = (f"{cfg['samples']} samples of {cfg['floats'] * 4} bytes (Zarr v3, uncompressed, chunks of "
            f"{cfg['chunk']}: {result['dataset_bytes'] / 2**20:.0f} MiB) on a store process with "
            f"{cfg['latency'] * 1000:g} ms a request; a stock scheduler, {WORKERS} `dask worker --no-nanny` "
            f"(dmdask.Worker) and {RANKS} rank processes counted as another node (every row crosses a row "
            f"channel), batches of {cfg['batch']}, a {cfg['step'] * 1000:g} ms training step, each rank checking "
            "every batch's values. Each configuration on a fresh cluster: a cold epoch, then a warm one. "
            f"`paused`: one worker SIGSTOPped once the ranks have their first batches, continued after "
            f"{2 * deadline(cfg):g} s, twice the ranks' reply deadline (half `dmdask.client.recovery-seconds` = "
            f"{cfg['recovery']}); the scheduler treats it as lost after `dmdask.worker.silent-seconds` = "
            f"{cfg['silent']} with no heartbeat (Dask's floor: 5 s). `flaky`: the store answers 503 to every "
            f"{FAIL_EVERY}th GET and holds every {HANG_EVERY}th for {HANG_SECONDS:g} s "
            f"(`dmdask.store.read-seconds` = {cfg['read_seconds']} cuts it; at the earlier default, 30 s, equal to "
            "`retry-seconds`, one hung request failed its block: `BlockReadError` after 1 try in 30.0 s). "
            "Store bytes: chunk bytes the store "
            "sent in the epoch; a paused worker's blocks are read again by the others (its share of the "
            "dataset, once). Every epoch asserts every sample exactly once. "
            f"Load average (1 min) at the end of each epoch: {min(loads):.1f}-{max(loads):.1f} on "
            f"{os.cpu_count()} cores.")
    return text + "\n\n" + table(result) + "\n"


def main(argv=None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=list(PRESETS), nargs="?", default="tiny")
    args = parser.parse_args(argv)
    result = run(args.preset)
    print(table(result))
    print(json.dumps(result["goals"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
