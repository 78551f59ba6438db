"""The several-node recipe, with the stock CLI: `dask scheduler` plus
`dask worker ADDR --worker-class dmdask.Worker`, capacities from dask config
environment variables (`DASK_DMDASK__WORKER__RAM`)."""
import os
import subprocess
import sys

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.testing.datasets import write_zarr, zarr_sample

from conftest import all_ids, run_epoch, wait_until

BIN = os.path.dirname(sys.executable)


@pytest.fixture
def cli_cluster(tmp_path):
    scheduler_file = str(tmp_path / "scheduler.json")
    env = dict(os.environ, DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING="False")
    procs = [subprocess.Popen([os.path.join(BIN, "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--dashboard-address", ":0", "--scheduler-file", scheduler_file],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)]
    for i, (ram, ssd) in enumerate([("2 MiB", "0"), ("1 MiB", "4 MiB")]):
        worker_env = dict(env, DASK_DMDASK__WORKER__RAM=ram, DASK_DMDASK__WORKER__SSD=ssd,
                          DASK_DMDASK__WORKER__SSD_DIR=str(tmp_path / f"ssd{i}"))
        procs.append(subprocess.Popen(
            [os.path.join(BIN, "dask"), "worker", "--scheduler-file", scheduler_file, "--worker-class",
             "dmdask.Worker", "--nthreads", "1", "--name", f"node{i}", "--host", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=worker_env))
    try:
        wait_until(lambda: os.path.exists(scheduler_file), 60, "the scheduler wrote its file")
        with distributed.Client(scheduler_file=scheduler_file, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            yield client
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)


def test_stock_cli_workers_with_config_from_environment(cli_cluster, tmp_path):
    client = cli_cluster
    path = write_zarr(str(tmp_path / "d.zarr"), 3001, sample_shape=(256,), chunk=100)  # ~3.1 MB
    spec = dmdask.Spec(path, batch_size=100)
    for epoch in range(2):
        per_rank = run_epoch(client, spec, epoch=epoch, world_size=2)
        ids = all_ids(per_rank)
        assert np.array_equal(np.sort(ids), np.arange(3001))
        for batches in per_rank:
            for b in batches:
                np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (256,)))
    stats = dmdask.stats(client)
    by_name = {info["name"]: addr for addr, info in client.scheduler_info()["workers"].items()}
    node0, node1 = stats["workers"][by_name["node0"]], stats["workers"][by_name["node1"]]
    assert node0["ram"]["capacity"] == 2 * 2**20 and node0["ssd"]["capacity"] == 0
    assert node1["ram"]["capacity"] == 2**20 and node1["ssd"]["capacity"] == 4 * 2**20
    assert node1["ssd"]["blocks"] > 0 and os.listdir(tmp_path / "ssd1")
    total = stats["total"]
    assert total["ram"]["blocks"] + total["ssd"]["blocks"] == 31  # the whole dataset fits: every block cached
    assert total["shared_store"]["requests"] == 31
