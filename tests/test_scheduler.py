"""dmdask's scheduler plugin on real worker processes: placement that holds with Dask's
work stealing on, one creation per cluster under concurrent ranks and jobs, the
registry, release."""
import concurrent.futures

import distributed
import numpy as np

import dmdask
from dmdask.source import dataset_name
from dmdask.testing.datasets import zarr_sample

from conftest import all_ids, run_epoch, wait_until

N = 3001  # divisible by neither the chunk (50) nor the batch sizes


ZARR = dict(n=N, sample_shape=(8,), chunk=50)  # the `zarr_path` fixture's dataset (conftest.py)


def _placement(dask_scheduler, name):
    """(planned worker, workers holding it) of every block of a dataset."""
    ds = dask_scheduler.extensions["dmdask"].datasets[name]
    out = []
    for k, worker in enumerate(ds.planned):
        ts = dask_scheduler.tasks.get(ds.info and f"dmdask-block-{ds.info.identity}-{k}")
        out.append((worker, sorted(ws.address for ws in ts.who_has) if ts is not None else []))
    return out


def _stealing(dask_scheduler):
    return "stealing" in dask_scheduler.extensions


def test_blocks_load_on_their_planned_workers_with_work_stealing_on(zarr_path):
    with dmdask.LocalCluster(n_workers=3, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        assert client.run_on_scheduler(_stealing), "the stock scheduler steals work"
        spec = dmdask.Spec(zarr_path, batch_size=64, seed=2)
        for epoch in range(2):
            ids = all_ids(run_epoch(client, spec, epoch=epoch, world_size=2))
            assert np.array_equal(np.sort(ids), np.arange(N))
        placement = client.run_on_scheduler(_placement, name=dataset_name(spec))
        assert len(placement) == 61
        assert all(holders == [planned] for planned, holders in placement), placement
        per_worker = {w: sum(1 for p, _ in placement if p == w) for w in client.scheduler_info()["workers"]}
        assert sorted(per_worker.values()) == [20, 20, 21]  # round-robin over the three workers
        total = dmdask.stats(client)["total"]
        assert total["shared_store"]["requests"] == 61  # every block read once over two epochs
        assert total["ram"]["blocks"] == 61


def test_concurrent_get_or_create_from_several_jobs_creates_once(zarr_path):
    """Four jobs (four clients), each one rank of four, start at once: one dataset, each
    block read once, every sample delivered once."""
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster:
        spec = dmdask.Spec(zarr_path, batch_size=37, seed=9, world_size=4)
        barrier = __import__("threading").Barrier(4)

        def job(rank):
            with distributed.Client(cluster) as client:
                barrier.wait()
                return [b["index"] for b in dmdask.batches(client, spec.replace(rank=rank), epoch=0)]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            per_rank = list(pool.map(job, range(4)))
        ids = np.concatenate([i for batches in per_rank for i in batches])
        assert len(ids) == N and np.array_equal(np.sort(ids), np.arange(N))
        with distributed.Client(cluster) as client:
            stats = dmdask.stats(client)
            assert [d["name"] for d in stats["datasets"]] == [dataset_name(spec)]
            assert stats["datasets"][0]["blocks"] == stats["datasets"][0]["loaded"] == 61
            assert stats["total"]["shared_store"]["requests"] == 61


def test_release_empties_the_tiers_and_the_next_epoch_reads_again(zarr_path):
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(zarr_path, batch_size=100)
        batches = list(dmdask.batches(client, spec))
        np.testing.assert_array_equal(batches[0]["x"], zarr_sample(batches[0]["index"]))
        first = dmdask.stats(client)["total"]["shared_store"]["bytes"]
        assert first > 0
        assert dmdask.release(client, spec) is True
        wait_until(lambda: not dmdask.stats(client)["total"]["ram"]["blocks"], 30, "the released blocks left RAM")
        stats = dmdask.stats(client)
        assert stats["total"]["ram"]["blocks"] == 0 and stats["total"]["ram"]["bytes"] == 0
        assert stats["datasets"] == []
        assert dmdask.release(client, spec) is False
        ids = all_ids([list(dmdask.batches(client, spec))])
        assert np.array_equal(np.sort(ids), np.arange(N))
        assert dmdask.stats(client)["total"]["shared_store"]["bytes"] == 2 * first


def test_stock_scheduler_preload_installs_the_plugin():
    with distributed.LocalCluster(n_workers=0, processes=False, scheduler_kwargs={"preload": ["dmdask"]},
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
        assert client.run_on_scheduler(lambda dask_scheduler: "dmdask" in dask_scheduler.plugins)


def test_a_stock_scheduler_gets_the_plugin_from_the_first_rank_that_asks(zarr_path):
    """No `--preload dmdask`: the first request finds no handler, registers the plugin
    (which installs the workers' side) and asks again; every sample comes once."""
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, worker_class=dmdask.Worker,
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
        assert "dmdask" not in cluster.scheduler.plugins
        ids = all_ids([list(dmdask.batches(client, dmdask.Spec(zarr_path, batch_size=64, seed=2)))])
        assert "dmdask" in cluster.scheduler.plugins
    assert np.array_equal(np.sort(ids), np.arange(N))


def test_blocks_are_created_again_after_a_cluster_restart(zarr_path):
    """`client.restart()` makes the scheduler forget every task (and the workers come back
    on new addresses): the next epoch recreates the blocks and delivers every sample."""
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(zarr_path, batch_size=128)
        assert np.array_equal(np.sort(all_ids([list(dmdask.batches(client, spec))])), np.arange(N))
        client.restart()
        batches = list(dmdask.batches(client, spec, epoch=1))
        assert np.array_equal(np.sort(all_ids([batches])), np.arange(N))
        np.testing.assert_array_equal(batches[3]["x"], zarr_sample(batches[3]["index"]))
        assert dmdask.stats(client)["total"]["shared_store"]["requests"] == 61  # since the restart
