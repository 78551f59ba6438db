"""dmdask: one `dmdask.Worker` process per simulated node, each on its own loopback address.

A rank is told its node's address as its host (`dmdask.client.host`), so it
maps the files of its own node's worker and asks the other nodes' workers for their rows
over TCP, as on separate hosts, although all share this machine."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np

from ..common import scheduler_address, stop_processes
from .dataset import sample_id

NAME, LABEL, FORMAT, STORE = "dmdask", "dmdask", "files", "http"
CAN = {"exactly_once": "yes: every sample to exactly one rank, every epoch (drop_last=False)",
       "cache": "RAM tier in shared memory on each node, sized to the node cache, never evicted",
       "shared_cache": "yes: one cache across the nodes"}
SCHEDULER_ENV = "DMDASK_BENCH_SCHEDULER"


def available():
    import distributed  # noqa: F401 - what a training script imports at its top

    import dmdask  # noqa: F401
    return None


def settings(cfg: dict) -> str:
    return (f"`dmdask.Spec(<the files' URLs>, batch_size={cfg['batch']}, block_size={cfg['block']}, seed=0, rank, "
            "world_size)`, exact global shuffle, default prefetch; `dask scheduler --preload dmdask` and per node "
            "one `dask worker --worker-class dmdask.Worker --nthreads <ranks per node> --no-nanny` with `ram` = the "
            "node cache, `ssd` = 0")


def node_host(node: int) -> str:
    return f"127.0.0.{11 + node}"


@contextlib.contextmanager
def services(run):
    """The scheduler and one worker per node; yields the environment the ranks need."""
    folder = os.path.join(run.root, "dask")
    os.makedirs(folder, exist_ok=True)
    scheduler_file = os.path.join(folder, "scheduler.json")
    env = dict(os.environ, DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING="False")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    # as the multi-node recipe starts it (README, docs/hpc.md): the plugin installed at start, not imported
    # by the scheduler on the first rank's request while every rank waits
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", "0", "--dashboard-address", ":0", "--scheduler-file", scheduler_file,
                               "--no-show", "--preload", "dmdask"], env=env, **quiet)]
    run.meter.watch(procs[0].pid, "dask scheduler")
    try:
        address = scheduler_address(scheduler_file)
        for node in range(run.nodes):
            node_env = dict(env, DASK_DMDASK__WORKER__RAM=str(run.node_cache_bytes), DASK_DMDASK__WORKER__SSD="0")
            p = subprocess.Popen(run.namespaces.prefix(node) + [
                sys.executable, "-m", "distributed.cli.dask_worker", address, "--worker-class", "dmdask.Worker",
                 "--nthreads", str(run.ranks_per_node), "--no-nanny", "--host", node_host(node),
                 "--name", f"node{node}", "--local-directory", run.node_dirs[node]], env=node_env, **quiet)
            procs.append(p)
            run.meter.watch(p.pid, "dmdask worker", node)
            run.meter.folder(f"{run.namespaces.shm(node)}/dmdask-ram-{p.pid}-*", node, kind="shm")
        _wait_workers(address, run.nodes)
        yield {SCHEDULER_ENV: address}
    finally:
        stop_processes(procs)


def _wait_workers(address: str, n: int) -> None:
    import distributed

    with distributed.Client(address, timeout=60) as client:
        client.wait_for_workers(n, timeout=120)


def batch_ids(batch) -> np.ndarray:
    return np.array([sample_id(d) for d in batch["data"]], dtype=np.int64)


class Loader:
    def __init__(self, ctx: dict):
        import dask.config
        import distributed

        import dmdask

        dask.config.set({"dmdask.client.host": node_host(ctx["node"])})  # this rank's simulated node
        self.client = distributed.Client(os.environ[SCHEDULER_ENV], timeout=60)
        # the file list the DataLoader and Grain read too (`ctx["file_urls"]`), not the folder to list
        self.spec = dmdask.Spec(ctx["file_urls"], batch_size=ctx["batch"], block_size=ctx["block"],
                                seed=ctx["seed"], rank=ctx["rank"], world_size=ctx["world"])

    def epoch(self, epoch: int):
        import dmdask

        return dmdask.batches(self.client, self.spec, epoch=epoch, progress=False)

    ids = staticmethod(batch_ids)

    def close(self):
        self.client.close()
