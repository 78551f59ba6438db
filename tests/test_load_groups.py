"""Load groups (`dmdask.plan.groups`, issue 41): in a large dataset one Dask task loads a
group of consecutive blocks of the load order, each block kept under its own key on its
worker. Here groups are made small (`GROUP_FROM_BLOCKS`, `GROUP_BLOCKS` lowered; the
scheduler of `dmdask.LocalCluster` runs in this process), over real worker processes and a
real HTTP store: every sample exactly once, each chunk read from the store once, the
scheduler holding one task per group, a lost worker's groups loaded again, and `release`."""
import os
import signal

import distributed
import numpy as np
import pytest
from conftest import run_epoch, wait_until

import dmdask
from benchmarks.store_server import StoreServer
from dmdask.plan import groups
from dmdask.plan.groups import Groups, group_key, parse_group_key
from dmdask.testing.datasets import write_zarr, zarr_sample

BLOCKS, CHUNK, SIZE = 64, 10, 4


def test_the_groups_partition_the_load_order_into_runs():
    order = np.random.default_rng(1).permutation(103)
    g = Groups(103, order, 8)
    assert g.count == 13
    members = [g.members(i) for i in range(g.count)]
    assert sorted(k for m in members for k in m) == list(range(103))  # every block in exactly one group
    assert members[0] == order[:8].tolist() and members[-1] == order[96:].tolist()  # runs of the load order
    assert all(g.of(k) == i for i, m in enumerate(members) for k in m)
    assert all(g.first(i) == m[0] for i, m in enumerate(members))
    assert parse_group_key(group_key("abc-1", 12)) == ("abc-1", 12) and parse_group_key("dmdask-block-x-1") is None
    with pytest.raises(ValueError, match="a load order of 3 blocks for a dataset of 4"):
        Groups(4, [0, 1, 2], 2)


def _task_keys(dask_scheduler=None):
    return sorted(str(k) for k in dask_scheduler.tasks)


@pytest.fixture
def grouped(monkeypatch, tmp_path):
    monkeypatch.setattr(groups, "GROUP_FROM_BLOCKS", 16)
    monkeypatch.setattr(groups, "GROUP_BLOCKS", SIZE)
    write_zarr(str(tmp_path / "d.zarr"), BLOCKS * CHUNK, chunk=CHUNK)
    with StoreServer(str(tmp_path)) as store, dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, \
            distributed.Client(cluster) as client:
        yield client, store, cluster


def _chunk_requests(store) -> dict:
    return {p: v["requests"] for p, v in store.stats()["by_path"].items() if "/c/" in p}


def test_a_grouped_dataset_loads_each_block_once_with_a_task_per_group(grouped):
    client, store, _ = grouped
    spec = dmdask.Spec(store.url + "/d.zarr", batch_size=32, seed=5, world_size=3)
    per_rank = run_epoch(client, spec)
    ids = np.concatenate([b["index"] for batches in per_rank for b in batches])
    assert sorted(ids.tolist()) == list(range(BLOCKS * CHUNK))
    for batches in per_rank:
        for b in batches:
            np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]))
    wait_until(lambda: dmdask.stats(client)["datasets"][0]["loaded"] == BLOCKS, 60, "every block loaded")
    keys = client.run_on_scheduler(_task_keys)
    assert len([k for k in keys if k.startswith("dmdask-group-")]) == BLOCKS // SIZE
    assert not [k for k in keys if k.startswith("dmdask-block-")]  # no task per block
    stats = dmdask.stats(client)
    assert stats["total"]["ram"]["blocks"] == BLOCKS  # each kept under its own block key
    assert all(stats["workers"][w]["ram"]["blocks"] % SIZE == 0 for w in stats["workers"])  # a group on one worker
    assert set(_chunk_requests(store).values()) == {1} and len(_chunk_requests(store)) == 2 * BLOCKS
    list(dmdask.batches(client, spec.replace(rank=0), epoch=1))  # a warm epoch reads nothing
    assert set(_chunk_requests(store).values()) == {1}
    assert dmdask.release(client, spec)
    wait_until(lambda: dmdask.stats(client)["total"]["ram"]["blocks"] == 0, 60, "the blocks released")


def test_the_groups_of_a_lost_worker_are_loaded_again_and_no_sample_is_lost(grouped):
    client, store, _ = grouped
    spec = dmdask.Spec(store.url + "/d.zarr", batch_size=32, seed=5)
    first = np.concatenate([b["index"] for b in dmdask.batches(client, spec, progress=False)])
    wait_until(lambda: dmdask.stats(client)["datasets"][0]["loaded"] == BLOCKS, 60, "every block loaded")
    pids = client.run(os.getpid)
    victim = min(pids)
    os.kill(pids[victim], signal.SIGKILL)
    wait_until(lambda: victim not in client.scheduler_info()["workers"], 60, "the worker removed")
    again = np.concatenate([b["index"] for b in dmdask.batches(client, spec, epoch=1, progress=False)])
    assert sorted(first.tolist()) == sorted(again.tolist()) == list(range(BLOCKS * CHUNK))
    wait_until(lambda: dmdask.stats(client)["datasets"][0]["loaded"] == BLOCKS, 60, "every block loaded again")
    requests = _chunk_requests(store)
    assert len(requests) == 2 * BLOCKS and set(requests.values()) <= {1, 2}  # the lost blocks read once more


def test_a_block_whose_load_fails_fails_its_group_naming_it_and_keeps_none_of_it(monkeypatch, tmp_path):
    """Block 5's chunks keep failing (503 past `dmdask.store.retry-seconds`): the batch that
    needs its group fails with block 5's `BlockReadError` (its samples named); none of its
    group's blocks stays held (their room freed), every other group loads."""
    import dask

    monkeypatch.setattr(groups, "GROUP_FROM_BLOCKS", 16)
    monkeypatch.setattr(groups, "GROUP_BLOCKS", SIZE)
    write_zarr(str(tmp_path / "d.zarr"), BLOCKS * CHUNK, chunk=CHUNK)
    with dask.config.set({"dmdask.store.retry-seconds": 0.5}), StoreServer(str(tmp_path)) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        store.fail_first(10**6, "d.zarr/label/c/5")  # block 5 (samples 50..59): its label chunk
        url = store.url + "/d.zarr"
        with pytest.raises(dmdask.BlockReadError) as raised:
            list(dmdask.batches(client, dmdask.Spec(url, batch_size=CHUNK * BLOCKS, shuffle=False)))
        assert url in str(raised.value) and "samples 50..59" in str(raised.value)
        wait_until(lambda: dmdask.stats(client)["datasets"][0]["loaded"] == BLOCKS - SIZE, 60, "the other groups")
        assert dmdask.stats(client)["datasets"][0]["erred"] == SIZE
        assert dmdask.stats(client)["total"]["ram"]["blocks"] == BLOCKS - SIZE
        store.fail_first(0)


def test_a_group_a_rank_waits_for_runs_next_on_its_worker(monkeypatch, tmp_path):
    """Each one-thread worker is busy with its first group (blocks 0..3, 4..7: their reads
    held by the store), its other groups queued in load order. A rank locates block 60
    (group 15, queued last on its worker): the scheduler tells that worker to run group 15
    next, so once the reads go on its blocks are read before those of the groups queued
    ahead of it there (3, 5, ..., 13)."""
    import threading

    from dmdask.client.datasets import open_dataset
    from dmdask.protocol.scheduler import SchedulerAPI

    monkeypatch.setattr(groups, "GROUP_FROM_BLOCKS", 16)
    monkeypatch.setattr(groups, "GROUP_BLOCKS", SIZE)
    write_zarr(str(tmp_path / "d.zarr"), BLOCKS * CHUNK, chunk=CHUNK)
    asked: dict[int, None] = {}  # blocks in the order their first chunk GET came
    going = threading.Event()

    def which(path: str) -> bool:
        if "/c/" not in path:
            return False
        block = int(path.split("/c/")[1].split("/")[0])
        asked.setdefault(block, None)
        return block < 2 * SIZE and not going.is_set()

    with StoreServer(str(tmp_path)) as store, dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, \
            distributed.Client(cluster) as client:
        store.hold(which)
        try:
            spec = dmdask.Spec(store.url + "/d.zarr", batch_size=CHUNK, shuffle=False)
            info = open_dataset(client, spec, 0).info  # no iterator: nothing else locates blocks
            wait_until(lambda: sorted(len(v) for v in client.processing().values()) == [8, 8], 60,
                       "each worker's 8 groups on it, the first running")
            wait_until(lambda: set(range(2 * SIZE)) <= set(asked), 60, "the first groups' reads held")
            found = client.sync(SchedulerAPI(client).locate, [info.block_key(60)], None, wait=0.5, planned=True)
            assert info.block_key(60) in found.pending  # its group is queued, waited for on the scheduler
            key = groups.group_key(info.identity, 15)

            def moved_ahead(dask_worker) -> bool:  # the scheduler's message reached the worker
                ts = dask_worker.state.tasks.get(key)
                return ts is not None and bool(ts.priority) and ts.priority[0] == float("-inf")

            wait_until(lambda: any(client.run(moved_ahead).values()), 60, "group 15 moved ahead on its worker")
        finally:
            going.set()  # held no more, still recorded
        wait_until(lambda: dmdask.stats(client)["datasets"][0]["loaded"] == BLOCKS, 60, "every block loaded")
        store.release()
    order = list(asked)
    assert max(order.index(b) for b in range(60, 64)) < min(order.index(b) for b in range(12, 16)), order
