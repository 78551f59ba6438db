"""Reading ahead (`dmdask.worker.read_ahead`): workers read the rows of per-sample-file
blocks bound for RAM while no rank's read waits, and still read each file once. Real
worker processes and a real HTTP store (which lists no sizes, so samples are charged to
the tier as they are read); the read pool's idleness with real threads."""
import asyncio
import threading
import time

import dask
import distributed
import numpy as np

import dmdask
from benchmarks.store_server import StoreServer
from dmdask.source import open_source
from dmdask.testing.datasets import folder_sample, write_folder
from dmdask.worker.filling import FillingBlock
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


def _read_ahead_or_given(client) -> tuple[int, int]:
    counts = dmdask.stats(client)["total"]["shared_store"]
    return counts["read_ahead"], counts["from_ranks"]


def test_workers_read_the_cached_blocks_before_any_rank_asks(tmp_path):
    """An iterator made and never advanced: its blocks are read ahead, each file once (its
    first batch by the rank itself, which gives those rows to the workers); the epoch
    afterwards reads nothing more and takes every row from RAM."""
    write_folder(str(tmp_path / "files"), classes=3, per_class=40)
    with StoreServer(str(tmp_path)) as server, dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(server.url + "/files", batch_size=8, block_size=10, seed=1)
        dmdask.batches(client, spec, progress=False).close()
        _wait_for(lambda: _read_ahead_or_given(client) == (112, 8), "112 rows read ahead, 8 given")
        assert sorted(_file_requests(server).values()) == [1] * 120
        per_rank = run_epoch(client, spec, world_size=2)
        ids = all_ids(per_rank)
        assert np.array_equal(np.sort(ids), np.arange(120))
        for batch in (b for batches in per_rank for b in batches):
            assert [bytes(d) for d in batch["data"]] == [folder_sample(i) for i in batch["index"]]
        assert sorted(_file_requests(server).values()) == [1] * 120  # nothing read for the epoch
        total = dmdask.stats(client)["total"]
        # stream hits: only the first batch the first iterator's rank read from the store
        assert total["ram"]["hits"] == 120 and total["stream"]["hits"] == 8


def test_rows_read_ahead_past_the_tiers_room_are_served_not_read_again(tmp_path):
    """A RAM tier that holds 3 samples: the first reads ahead bring more rows than it
    keeps; those are held until a rank takes them, so epoch 1 still reads each file once,
    and epoch 2 reads exactly the files the tier did not keep."""
    write_folder(str(tmp_path / "files"), classes=2, per_class=20, min_size=1000, max_size=1000)
    with StoreServer(str(tmp_path)) as server, dmdask.LocalCluster(n_workers=1, ram=3500) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(server.url + "/files", batch_size=8, block_size=20, seed=2)
        with dask.config.set({"dmdask.client.read-first-batch": False}):  # every row to the read ahead
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
        # nothing in line, nothing under way: the files read are those read ahead before, and
        # the rank's first batch (read by the rank itself), not all
        read_ahead = dmdask.stats(client)["total"]["shared_store"]["read_ahead"]
        assert sum(_file_requests(server).values()) == read_ahead + 8 < 200


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


def test_a_queued_call_hastened_runs_before_later_priorities():
    """`hasten`: a read ahead (LAST) still queued behind later batches' reads runs next once
    an earlier batch waits for it, and counts as urgent until it ends; a call already run,
    or of an earlier priority, is left as it is."""
    pool = PriorityPool(1, "test-read")
    ran, release = [], threading.Event()
    try:
        blocker = pool.submit_at(0, release.wait, 10)  # holds the one thread
        ahead = pool.submit_at(LAST, ran.append, "ahead")
        later = [pool.submit_at(5, ran.append, f"batch 5.{i}") for i in range(3)]
        pool.hasten(later[0], 7)  # a later priority than its own: no change
        pool.hasten(ahead, 2)
        assert not pool.idle()
        release.set()
        for future in [blocker, ahead] + later:
            future.result(timeout=10)
        assert ran == ["ahead", "batch 5.0", "batch 5.1", "batch 5.2"]
        pool.hasten(ahead, 0)  # ran already: nothing
        _wait_for(pool.idle, "the pool to be idle", 10)
    finally:
        pool.shutdown()


class _Reads:
    """What `FillingBlock` uses of a worker's `BlockCache`: its read threads (a real
    `PriorityPool` of one thread) and `read_rows`, here recording the order of the reads."""

    def __init__(self):
        self.reads, self.order = PriorityPool(1, "test-read"), []

    def read_rows(self, reader, rows):
        self.order.append(rows.tolist())
        return reader.read_rows(rows)


def test_a_batch_waiting_for_a_queued_read_ahead_hastens_it(tmp_path):
    """Priority inversion, as it held batch 0 of a rank to the epoch's end: a rank asks for
    a row that a read ahead (queued at LAST behind later batches' reads) brings; that read
    is hastened to the batch's priority, so it runs before the later batches' reads, and
    the row comes from it (each file read once)."""
    write_folder(str(tmp_path / "files"), classes=1, per_class=16)
    reader = open_source(dmdask.Spec(str(tmp_path / "files"), batch_size=4, block_size=16)).reader(0)
    cache, release = _Reads(), threading.Event()

    async def scenario():
        block = FillingBlock(reader)
        blocker = cache.reads.submit_at(0, release.wait, 10)  # a read under way holds the thread
        block.read_ahead(np.arange(4), cache)  # rows 0-3, queued at LAST
        later = asyncio.ensure_future(block.serve(np.array([9]), cache, 5))  # batch 5's own read, queued
        await asyncio.sleep(0)  # a serve submits its read before its first await: once round the loop is enough
        first = asyncio.ensure_future(block.serve(np.array([2]), cache, 0))  # batch 0 waits for the read ahead
        await asyncio.sleep(0)
        release.set()
        (got, read), _ = await first, await later
        assert blocker.result(timeout=10) is True
        assert bytes(got["data"][0]) == folder_sample(2) and read == 0  # read by the read ahead, not again
        return block

    try:
        block = asyncio.run(scenario())
    finally:
        cache.reads.shutdown()
    assert cache.order == [[0, 1, 2, 3], [9]]
    assert block.have[[0, 1, 2, 3, 9]].all() and block.have.sum() == 5
