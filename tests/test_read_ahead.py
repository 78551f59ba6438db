"""Reading ahead (`dmdask.worker.read_ahead`): workers read the rows of per-sample-file
blocks bound for RAM while no rank's read waits, and still read each file once. Real
worker processes and a real HTTP store (which lists no sizes, so samples are charged to
the tier as they are read); the read pool's idleness with real threads."""
import threading
import time

import distributed
import numpy as np

import dmdask
from benchmarks.store_server import StoreServer
from dmdask.testing.datasets import folder_sample, write_folder
from dmdask.worker.read_ahead import IN_FLIGHT, ROWS
from dmdask.worker.reads import LAST, PriorityPool

from conftest import all_ids, run_epoch


def _file_requests(server) -> dict:
    return {p: v["requests"] for p, v in server.stats()["by_path"].items() if p.endswith(".bin")}


def _settled(dask_worker) -> bool:
    """Whether a worker has no block in line to read ahead and no read ahead under way."""
    ahead = dask_worker.extensions["dmdask"].ahead
    return not len(ahead) and not ahead.running


def _wait_for(condition, what: str, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.05)


def test_workers_read_the_cached_blocks_before_any_rank_asks(tmp_path):
    """An iterator made and never advanced: its blocks are read ahead, each file once;
    the epoch afterwards reads nothing more and takes every row from RAM."""
    write_folder(str(tmp_path / "files"), classes=3, per_class=40)
    with StoreServer(str(tmp_path)) as server, dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(server.url + "/files", batch_size=8, block_size=10, seed=1)
        dmdask.batches(client, spec, progress=False).close()
        _wait_for(lambda: dmdask.stats(client)["total"]["shared_store"]["read_ahead"] == 120, "120 rows read ahead")
        assert sorted(_file_requests(server).values()) == [1] * 120
        per_rank = run_epoch(client, spec, world_size=2)
        ids = all_ids(per_rank)
        assert np.array_equal(np.sort(ids), np.arange(120))
        for batch in (b for batches in per_rank for b in batches):
            assert [bytes(d) for d in batch["data"]] == [folder_sample(i) for i in batch["index"]]
        assert sorted(_file_requests(server).values()) == [1] * 120  # nothing read for the epoch
        total = dmdask.stats(client)["total"]
        assert total["ram"]["hits"] == 120 and total["stream"]["hits"] == 0


def test_rows_read_ahead_past_the_tiers_room_are_served_not_read_again(tmp_path):
    """A RAM tier that holds 3 samples: the first reads ahead bring more rows than it
    keeps; those are held until a rank takes them, so epoch 1 still reads each file once,
    and epoch 2 reads exactly the files the tier did not keep."""
    write_folder(str(tmp_path / "files"), classes=2, per_class=20, min_size=1000, max_size=1000)
    with StoreServer(str(tmp_path)) as server, dmdask.LocalCluster(n_workers=1, ram=3500) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(server.url + "/files", batch_size=8, block_size=20, seed=2)
        dmdask.batches(client, spec, progress=False).close()
        # reads ahead start once the blocks reach the worker, and stop once the tier takes
        # no more samples (settled alone also holds before the blocks arrive)
        _wait_for(lambda: dmdask.stats(client)["total"]["shared_store"]["read_ahead"] > 0
                  and all(client.run(_settled).values()), "reading ahead to start and stop")
        read_ahead = dmdask.stats(client)["total"]["shared_store"]["read_ahead"]
        for epoch in (0, 1):
            assert np.array_equal(np.sort(all_ids(run_epoch(client, spec, epoch=epoch, world_size=2))),
                                  np.arange(40))
            if epoch == 0:
                assert sorted(_file_requests(server).values()) == [1] * 40
        total = dmdask.stats(client)["total"]
        kept = total["ram"]["samples"]
        assert 0 < kept < read_ahead <= IN_FLIGHT * ROWS  # the first reads ahead, not all of their rows kept
        assert dmdask.stats(client)["total"]["shared_store"]["read_ahead"] == read_ahead
        requests = _file_requests(server)
        assert sorted(requests.values()) == [1] * kept + [2] * (40 - kept)


def test_a_released_dataset_is_read_ahead_no_further(tmp_path):
    """Releasing a dataset while its blocks are read ahead: the workers let go of them at
    once and read none of their files afterwards."""
    write_folder(str(tmp_path / "files"), classes=4, per_class=50)
    with StoreServer(str(tmp_path), latency=0.2) as server, \
            dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(server.url + "/files", batch_size=8, block_size=10, seed=3)
        dmdask.batches(client, spec, progress=False).close()
        _wait_for(lambda: dmdask.stats(client)["total"]["shared_store"]["read_ahead"] > 0, "a read ahead")
        assert dmdask.release(client, spec)

        _wait_for(lambda: all(client.run(_settled).values()), "the released blocks let go")
        # nothing in line, nothing under way: the files read are those read ahead before, not all
        read_ahead = dmdask.stats(client)["total"]["shared_store"]["read_ahead"]
        assert sum(_file_requests(server).values()) == read_ahead < 200


def test_the_read_pool_says_when_no_rank_read_is_queued_or_running():
    """`idle`: no call of a priority before LAST queued or running; `on_idle` once the
    last such call ends, not for calls at LAST (reads ahead, background loads)."""
    pool = PriorityPool(2, "test-read")
    idled = []
    pool.on_idle = lambda: idled.append(threading.current_thread().name)
    release = threading.Event()
    try:
        background = pool.submit_at(LAST, release.wait, 10)
        assert pool.idle()
        urgent = [pool.submit_at(p, release.wait, 10) for p in (1, 0)]  # one runs, one queues
        assert not pool.idle()
        release.set()
        for future in urgent + [background]:
            assert future.result(timeout=10) is True
        _wait_for(lambda: idled, "on_idle", 10)
        assert pool.idle() and len(idled) == 1 and idled[0].startswith("test-read")
    finally:
        pool.shutdown()
