"""A worker process killed mid-epoch: no sample lost, none repeated."""
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import dask.config
import distributed
import numpy as np
import pytest

import dmdask
from dmdask.testing.datasets import write_zarr, zarr_sample

from conftest import wait_until


def test_killed_worker_mid_epoch_loses_and_repeats_nothing(tmp_path):
    n = 2000
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=(8,), chunk=50)
    with dmdask.LocalCluster(n_workers=3, ram="8 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=20, seed=4, prefetch=4)
        # epoch 0 warms the cache on all three workers
        for r in range(2):
            for _ in dmdask.batches(client, spec.replace(rank=r, world_size=2)):
                pass
        pids = client.run(os.getpid)
        victim_address = sorted(pids)[1]
        got = [[], []]
        errors = []
        started = threading.Barrier(3)

        def rank(r):
            try:
                it = dmdask.batches(client, spec.replace(rank=r, world_size=2), epoch=1)
                started.wait()
                for b in it:
                    np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]))
                    got[r].append(b["index"])
                    time.sleep(0.01)  # a training step
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        started.wait()
        wait_until(lambda: all(len(g) >= 3 for g in got) or errors, 60, "both ranks handed out batches")
        os.kill(pids[victim_address], signal.SIGKILL)
        delivered_at_kill = [len(g) for g in got]
        assert all(0 < d < n // 2 // 20 for d in delivered_at_kill), delivered_at_kill
        for t in threads:
            t.join(120)
        assert not errors, errors
        ids = np.concatenate(got[0] + got[1])
        assert len(ids) == n
        assert np.array_equal(np.sort(ids), np.arange(n))
        assert victim_address not in client.scheduler_info()["workers"]


def identity_transform(batch):
    return batch


@pytest.mark.parametrize("through_workers", [False, True])
def test_every_worker_killed_at_once_recovers_when_the_nannies_restart_them(tmp_path, through_workers):
    """A node reboot: all workers SIGKILLed mid-epoch, restarted by their nannies. The
    epoch goes on (blocks planned anew over the new workers, read again from the store)
    and every sample comes once; the next epoch too."""
    n = 1000
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=(8,), chunk=50)
    with dmdask.LocalCluster(n_workers=2, ram="8 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=20, seed=4, prefetch=4,
                           transform=identity_transform if through_workers else None)
        list(dmdask.batches(client, spec))
        pids = client.run(os.getpid)
        it = dmdask.batches(client, spec, epoch=1)
        got = [next(it)["index"] for _ in range(5)]
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        for b in it:
            np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]))
            got.append(b["index"])
        assert np.array_equal(np.sort(np.concatenate(got)), np.arange(n))
        # the epoch may end before the scheduler has dropped the killed workers (rows mapped from
        # their files stay readable): wait for the cluster the next epoch runs on
        def replaced():
            workers = client.scheduler_info()["workers"]  # address -> info; a restarted worker has a new port
            return len(workers) == 2 and not set(workers) & set(pids)

        wait_until(replaced, 120, "the killed workers replaced by two new ones")
        assert not set(client.run(os.getpid).values()) & set(pids.values())  # new worker processes
        again = np.concatenate([b["index"] for b in dmdask.batches(client, spec, epoch=2)])
        assert np.array_equal(np.sort(again), np.arange(n))


def test_no_worker_left_is_a_clear_error_within_the_configured_time(tmp_path, caplog):
    """... and the wait says once what it waits for."""
    n = 400
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=(8,), chunk=50)
    with dmdask.LocalCluster(n_workers=2, ram="8 MiB") as cluster, distributed.Client(cluster) as client:
        # one batch ahead: the rest of the epoch (12.8 KB) would otherwise be one request, which
        # could be answered before the workers leave (a timing the test must not depend on)
        spec = dmdask.Spec(path, batch_size=20, transform=identity_transform, prefetch=1)
        it = dmdask.batches(client, spec)
        first = next(it)  # with the default recovery time: a loaded machine may take over 2 s to start
        with dask.config.set({"dmdask.client.recovery-seconds": 2}):
            cluster.scale(0)
            wait_until(lambda: not client.scheduler_info()["workers"], 60, "the workers left")
            with caplog.at_level(logging.WARNING, logger="dmdask"), \
                    pytest.raises(dmdask.NoWorkersError, match="no workers for 2 s"):
                for _ in it:
                    pass
            said = [r.getMessage() for r in caplog.records if "waiting up to 2 s" in r.getMessage()]
            assert len(said) == 1 and "--worker-class dmdask.Worker" in said[0]
            with pytest.raises(dmdask.NoWorkersError, match="recovery-seconds"):
                next(iter(dmdask.batches(client, spec, epoch=1)))
        assert len(first["index"]) == 20


def _start_cluster(port: int, tmp_path, tag: str) -> list:
    """A stock `dask scheduler` on `port` and two `dask worker --worker-class dmdask.Worker`."""
    dask_bin = os.path.join(os.path.dirname(sys.executable), "dask")
    address = f"tcp://127.0.0.1:{port}"
    here = os.path.dirname(os.path.abspath(__file__))  # the workers unpickle this module's transform
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    procs = [subprocess.Popen([dask_bin, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--dashboard-address", ":0", "--preload", "dmdask"], **quiet)]
    for i in range(2):
        procs.append(subprocess.Popen([dask_bin, "worker", address, "--worker-class", "dmdask.Worker",
                                       "--nthreads", "1", "--host", "127.0.0.1", "--no-nanny",
                                       "--local-directory", str(tmp_path / f"{tag}-w{i}")], **quiet))
    return procs


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(30)


def test_a_lost_scheduler_is_a_clear_error_and_the_job_resumes_against_a_new_one(tmp_path):
    """The scheduler is SIGKILLed mid-epoch: the rank gets SchedulerLostError within
    dmdask.client.scheduler-seconds, and a job resumed from its state_dict() against a
    restarted scheduler (and workers) delivers the rest of the epoch exactly once."""
    from framework_cases import free_port

    n = 1200
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=(8,), chunk=50)
    port = free_port()
    spec = dmdask.Spec(path, batch_size=20, seed=9, transform=identity_transform, prefetch=2)
    first = _start_cluster(port, tmp_path, "a")
    got = []
    try:
        with dask.config.set({"dmdask.client.scheduler-seconds": 3}), \
                distributed.Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            it = dmdask.batches(client, spec, epoch=1)
            got += [next(it)["index"] for _ in range(5)]
            first[0].kill()
            first[0].wait(30)
            with pytest.raises(dmdask.SchedulerLostError, match="scheduler-seconds"):
                for b in it:
                    got.append(b["index"])
            state = it.state_dict()
    finally:
        _stop(first)
    assert state["position"] == len(got) >= 5
    second = _start_cluster(port, tmp_path, "b")
    try:
        with distributed.Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            for b in dmdask.batches(client, spec, epoch=1, resume=state):
                np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]))
                got.append(b["index"])
    finally:
        _stop(second)
    ids = np.concatenate(got)
    assert len(ids) == n and np.array_equal(np.sort(ids), np.arange(n))


class Poison:
    """A transform that fails on the batch holding sample `poison`: by raising `exc`, or by
    killing its process (exc=None)."""

    def __init__(self, poison: int, exc=None):
        self.poison, self.exc = poison, exc

    def __call__(self, batch):
        if self.poison in batch["index"]:
            if self.exc is None:
                os._exit(3)
            raise self.exc
        return dict(batch, x=batch["x"] + 1)


def _poisoned_batch(spec, n: int, epoch: int, i: int) -> int:
    from dmdask.plan.order import EpochOrder, RankShare

    share = RankShare(EpochOrder(n, 50, shuffle=True, seed=spec.seed, epoch=epoch), spec.rank, spec.world_size,
                      spec.batch_size, spec.drop_last)
    return int(share.batch(i)[7])


@pytest.mark.parametrize("how", ["raises", "SystemExit", "kills its process"])
def test_a_poisoned_transform_fails_its_batch_once_and_delivers_those_before(tmp_path, how):
    """The transform fails on batch 6 of the epoch: batches 0..5 are delivered, then one
    TransformError naming the batch's samples; state_dict() points at batch 6; a
    transform that kills its process costs at most one worker, and is not replayed on
    the others (they all live on)."""
    n = 1000
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=(8,), chunk=50)
    with dmdask.LocalCluster(n_workers=2, ram="8 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=20, seed=3, prefetch=8)
        poison = _poisoned_batch(spec, n, 1, 6)
        exc = {"raises": ValueError("bad pixel"), "SystemExit": SystemExit(2), "kills its process": None}[how]
        spec = spec.replace(transform=Poison(poison, exc))
        list(dmdask.batches(client, spec.replace(transform=None)))  # the cache is warm
        pids = set(client.run(os.getpid).values())
        it = dmdask.batches(client, spec, epoch=1)
        got = []
        with pytest.raises(dmdask.TransformError) as info:
            for b in it:
                np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]) + 1)
                got.append(b["index"])
        assert len(got) == 6 and it.state_dict()["position"] == 6
        assert str(poison) in str(info.value) or "samples" in str(info.value)
        assert {"raises": "bad pixel", "SystemExit": "SystemExit", "kills its process": "killed its process"}[how] \
            in str(info.value)
        wait_until(lambda: len(client.scheduler_info()["workers"]) == 2, 60, "two workers (a lost one restarted)")
        survivors = pids & set(client.run(os.getpid).values())
        assert len(survivors) >= (1 if how == "kills its process" else 2)  # at most one worker lost
        # the cluster is usable after: the rest of the epoch from the failing batch, without the poison
        rest = [b["index"] for b in dmdask.batches(client, spec.replace(transform=None), epoch=1,
                                                  resume=it.state_dict())]
        ids = np.concatenate(got + rest)
        assert np.array_equal(np.sort(ids), np.arange(n))


class Slow:
    """x + 1, 50 ms a batch: a worker closing is running it."""

    def __call__(self, batch):
        time.sleep(0.05)
        return dict(batch, x=batch["x"] + 1)


def test_closing_the_cluster_under_a_transform_iterator_blames_no_transform(tmp_path, caplog):
    """The cluster closed on purpose while a rank iterates with a transform (its requests
    in flight meet closing workers): its workers said they were closing, so the rank does
    not say that a worker was lost while it ran the transform, nor run batches in a
    process of their own (it did). The rank then finds no workers and fails as it does
    without them."""
    path = write_zarr(str(tmp_path / "d.zarr"), 20_000, sample_shape=(8,), chunk=64)
    cluster = dmdask.LocalCluster(n_workers=2, ram="16 MiB", dashboard_address=None)
    client = distributed.Client(cluster)
    seen, ended = [], []

    def consume(it):
        try:
            for b in it:
                np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (8,)) + 1)
                seen.append(len(b["index"]))
        except Exception as exc:  # noqa: BLE001 - what ended the iteration, asserted below
            ended.append(exc)

    try:
        with dask.config.set({"dmdask.client.recovery-seconds": 3}), \
                caplog.at_level(logging.WARNING, logger="dmdask"):
            it = dmdask.batches(client, dmdask.Spec(path, batch_size=64, transform=Slow(), prefetch=8))
            reader = threading.Thread(target=consume, args=(it,), daemon=True)
            reader.start()
            wait_until(lambda: len(seen) >= 4, 60, "the first batches")
            cluster.close()
            reader.join(60)
            assert not reader.is_alive()
    finally:
        client.close()
        cluster.close()
    assert sum(seen) < 20_000 and ended, "the cluster closed before the epoch's end"
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "while it ran the transform" in m], said


def test_capacity_lost_with_a_worker_is_won_back_when_it_restarts(tmp_path):
    """A worker holding half the cache is SIGKILLed: its blocks are streamed by the
    survivor (no room there), then loaded on the restarted worker, one read each; later
    epochs read nothing from the store."""
    from benchmarks.store_server import StoreServer

    root = tmp_path / "pfs"
    write_zarr(str(root / "d.zarr"), 400, chunk=50)  # 8 blocks of 2,000 bytes
    with StoreServer(str(root)) as server, \
            dmdask.LocalCluster(n_workers=2, ram="9 KiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(server.url + "/d.zarr", batch_size=25, seed=1)
        list(dmdask.batches(client, spec))
        assert dmdask.stats(client)["total"]["ram"]["blocks"] == 8
        pids = client.run(os.getpid)
        os.kill(pids[sorted(pids)[0]], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the lost blocks were not won back"
            time.sleep(0.3)
            try:
                total = dmdask.stats(client)["total"]
            except OSError:  # a worker is still leaving or joining
                continue
            if total["ram"]["blocks"] == 8 and total["streamed_blocks"] == 0:
                break
        for epoch in (1, 2):
            ids = np.concatenate([b["index"] for b in dmdask.batches(client, spec, epoch=epoch)])
            assert np.array_equal(np.sort(ids), np.arange(400))
        chunks = {p: v["requests"] for p, v in server.stats()["by_path"].items() if "/c/" in p}
        assert len(chunks) == 16 and sorted(set(chunks.values())) == [1, 2]  # the lost blocks: read once more
        assert sum(n == 2 for n in chunks.values()) == 8  # 4 blocks (x and label chunks each)
