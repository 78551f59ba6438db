"""dmdask.batches on real worker processes: exactly-once, content, determinism, resume."""
import os
import time

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.testing.datasets import (folder_sample, write_folder, zarr_label,
                                     zarr_sample)

from conftest import all_ids, run_epoch

N = 1003  # divisible by neither the chunk (64) nor the batch size (50)


ZARR = dict(n=N, sample_shape=(4, 3), chunk=64)  # the `zarr_path` fixture's dataset (conftest.py)


def test_every_sample_exactly_once_over_ranks_and_epochs(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=50, seed=3)
    orders = []
    for epoch in range(3):
        per_rank = run_epoch(client, spec, epoch=epoch, world_size=3)
        ids = all_ids(per_rank)
        assert len(ids) == N
        assert np.array_equal(np.sort(ids), np.arange(N))
        counts = [len(batches) for batches in per_rank]
        assert max(counts) - min(counts) <= 1
        for batches in per_rank:
            for b in batches:
                assert set(b) == {"x", "label", "index"}
                assert b["index"].dtype == np.int64
                np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (4, 3)))
                np.testing.assert_array_equal(b["label"], zarr_label(b["index"]))
        orders.append(ids)
    assert not np.array_equal(orders[0], orders[1])


def test_drop_last_same_number_of_full_batches(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=50, drop_last=True)
    per_rank = run_epoch(client, spec, world_size=3)
    assert [len(b) for b in per_rank] == [6, 6, 6]
    ids = all_ids(per_rank)
    assert len(ids) == 900 and len(np.unique(ids)) == 900


def test_order_is_the_same_on_another_cluster_size(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=64, seed=11, rank=1, world_size=2)
    here = [b["index"] for b in dmdask.batches(client, spec, epoch=1)]
    with dmdask.LocalCluster(n_workers=1, ram="1 MiB") as cluster, distributed.Client(cluster) as other:
        there = [b["index"] for b in dmdask.batches(other, spec, epoch=1)]
    assert len(here) == len(there) == 8
    for a, b in zip(here, there):
        np.testing.assert_array_equal(a, b)


def test_resume_mid_epoch_continues_exactly_after_the_last_batch(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=30, seed=7, rank=1, world_size=2, prefetch=4)
    full = [b["index"] for b in dmdask.batches(client, spec, epoch=2)]
    it = dmdask.batches(client, spec, epoch=2)
    first = [next(it)["index"] for _ in range(5)]
    state = it.state_dict()
    it.close()
    assert state["position"] == 5
    rest = [b["index"] for b in dmdask.batches(client, spec, epoch=2, resume=state)]
    assert len(first) + len(rest) == len(full)
    for a, b in zip(first + rest, full):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(dmdask.SpecError, match="seed"):
        dmdask.batches(client, spec.replace(seed=8), epoch=2, resume=state)
    with pytest.raises(dmdask.SpecError, match="epoch"):
        dmdask.batches(client, spec, epoch=3, resume=state)


def _take(client, spec, epoch, count, resume=None):
    """`count` batches of a rank (all when None), then its state."""
    it = dmdask.batches(client, spec, epoch=epoch, resume=resume)
    got = [b["index"] for _, b in zip(range(len(it) if count is None else count), it)]
    state = it.state_dict()
    it.close()
    return got, state


@pytest.mark.parametrize("worlds", [(3, 2), (2, 4), (3, 1, 5)])
def test_elastic_resume_delivers_the_rest_of_the_epoch_exactly_once(client, zarr_path, worlds):
    """Ranks stop part-way, each at its own batch; the job restarts with another world
    size (and again): every sample of the epoch is delivered once over all generations."""
    n = 1003
    delivered, states = [], None
    for generation, world in enumerate(worlds):
        last = generation == len(worlds) - 1
        new_states = []
        for rank in range(world):
            spec = dmdask.Spec(zarr_path, batch_size=16, seed=4, rank=rank, world_size=world, prefetch=4)
            got, state = _take(client, spec, 1, None if last else 3 + rank, resume=states)
            delivered += got
            new_states.append(state)
        states = new_states
        assert all(s["position"] == (3 + s["rank"]) for s in states) or last
    ids = np.concatenate(delivered)
    assert len(ids) == n and np.array_equal(np.sort(ids), np.arange(n))
    import json
    assert json.loads(json.dumps(states)) == states  # plain values: a launcher may keep them as JSON


def test_elastic_resume_refuses_an_incomplete_or_mixed_set_of_states(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=16, seed=4, rank=0, world_size=3)
    states = [_take(client, spec.replace(rank=r), 1, 2)[1] for r in range(3)]
    with pytest.raises(dmdask.SpecError, match=r"ranks 0..2 once each"):
        dmdask.batches(client, spec.replace(world_size=2), epoch=1, resume=states[:2] + states[:1])
    with pytest.raises(dmdask.SpecError, match="list of every rank's state"):
        dmdask.batches(client, spec.replace(world_size=2), epoch=1, resume=states[0])
    with pytest.raises(dmdask.SpecError, match="epoch"):
        dmdask.batches(client, spec.replace(world_size=2), epoch=2, resume=states)
    # the same world size: each rank picks its own state from the list, same batches as before
    rest = _take(client, spec.replace(rank=1), 1, None, resume=states)[0]
    full = _take(client, spec.replace(rank=1), 1, None)[0]
    for a, b in zip(rest, full[2:]):
        np.testing.assert_array_equal(a, b)
    assert len(rest) == len(full) - 2


def test_prefetch_window_is_bounded(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=10, prefetch=3)
    it = dmdask.batches(client, spec)
    seen = 0
    for _ in it:
        in_flight_or_ready = it.requested - it.position
        assert 0 <= in_flight_or_ready <= 3
        seen += 1
    assert seen == len(it) == 101


def add_worker_pid(batch):
    batch = dict(batch)
    batch["pid"] = np.full(len(batch["index"]), os.getpid())
    batch["x"] = batch["x"] * 2
    return batch


def test_transform_runs_on_the_workers_after_the_cache(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=100, transform=add_worker_pid, keys=["x"])
    batches = list(dmdask.batches(client, spec))
    pids = {int(p) for b in batches for p in b["pid"]}
    worker_pids = set(client.run(os.getpid).values())
    assert pids and pids <= worker_pids and os.getpid() not in pids
    for b in batches:
        assert set(b) == {"x", "index", "pid"}
        np.testing.assert_array_equal(b["x"], 2 * zarr_sample(b["index"], (4, 3)))


def test_per_sample_transform(client, zarr_path):
    spec = dmdask.Spec(zarr_path, batch_size=64, keys=["label"],
                       transform=dmdask.per_sample(lambda s: {"label": s["label"] + 100, "index": s["index"]}))
    batch = next(iter(dmdask.batches(client, spec)))
    np.testing.assert_array_equal(batch["label"], zarr_label(batch["index"]) + 100)


def stamp_context(batch):
    """A transform that records what `dmdask.transform_context()` tells it."""
    ctx = dmdask.transform_context()
    n = len(batch["index"])
    return {"index": batch["index"], "epoch": np.full(n, ctx.epoch), "seed": np.full(n, ctx.seed)}


def test_transform_context_gives_the_batch_epoch_and_seed(client, zarr_path):
    assert dmdask.transform_context() is None  # outside a transform dmdask runs
    spec = dmdask.Spec(zarr_path, batch_size=200, seed=5, keys=["label"], transform=stamp_context)
    for epoch in (0, 3):
        batches = list(dmdask.batches(client, spec, epoch=epoch))
        assert all((b["epoch"] == epoch).all() and (b["seed"] == 5).all() for b in batches)


def test_transform_context_reaches_an_isolated_transform():
    from dmdask.spec import TransformContext, dumps_transform
    from dmdask.worker.transforms import transform_isolated

    batch = {"index": np.arange(3, dtype=np.int64)}
    done, error = transform_isolated(dumps_transform(stamp_context), [batch], TransformContext(epoch=7, seed=2))
    assert error is None
    np.testing.assert_array_equal(done[0]["epoch"], [7, 7, 7])
    np.testing.assert_array_equal(done[0]["seed"], [2, 2, 2])


def test_folder_of_files_varying_sizes(client, tmp_path):
    root = write_folder(str(tmp_path / "imagenet"), classes=3, per_class=25)
    spec = dmdask.Spec(root, batch_size=8, block_size=10)
    per_rank = run_epoch(client, spec, world_size=2)
    ids = all_ids(per_rank)
    assert np.array_equal(np.sort(ids), np.arange(75))
    for batches in per_rank:
        for b in batches:
            assert b["data"].dtype == object and b["label"].dtype == np.int64
            for i, data, label in zip(b["index"], b["data"], b["label"]):
                assert data.dtype == np.uint8
                assert data.tobytes() == folder_sample(int(i))
                assert label == i // 25


def record_pid(batch):
    return dict(batch, pid=np.full(len(batch["index"]), os.getpid()))


def test_rank_r_is_served_by_local_worker_r_mod_n(client, zarr_path):
    pid_of = client.run(os.getpid)
    workers = sorted(pid_of)
    for rank in range(4):
        spec = dmdask.Spec(zarr_path, batch_size=100, rank=rank, world_size=4, transform=record_pid)
        pids = {int(p) for b in dmdask.batches(client, spec) for p in b["pid"]}
        assert pids == {pid_of[workers[rank % 2]]}


def _wait_for(gate: str):
    """A transform that blocks until the file `gate` exists (60 s at most), leaving a
    file `<gate>.entered-*` for each call it blocks."""
    def transform(batch):
        import os
        import time
        import uuid
        open(f"{gate}.entered-{uuid.uuid4().hex}", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate} never appeared")
            time.sleep(0.02)
        return batch
    return transform


def test_a_slow_transform_does_not_starve_another_jobs_reads(zarr_path, tmp_path):
    """Job A's transforms block every thread they may use; job B, reading a folder on the
    same worker, still gets every sample (reads have a pool of their own)."""
    import threading

    folder = write_folder(str(tmp_path / "files"), classes=2, per_class=30)
    gate = str(tmp_path / "gate")
    with dmdask.LocalCluster(n_workers=1, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        slow = dmdask.Spec(zarr_path, batch_size=10, transform=_wait_for(gate), world_size=4)
        got, errors = [[] for _ in range(4)], []

        def rank(r):
            try:
                got[r] = [b["index"] for b in dmdask.batches(client, slow.replace(rank=r))]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(tmp_path) if f.startswith("gate.entered-")]) < 2:
            assert time.monotonic() < deadline and not errors, "job A's transforms never started"
            time.sleep(0.05)  # then: every transform thread is blocked, 8 requests want one
        fast = dmdask.Spec(folder, batch_size=7, block_size=8)
        ids = np.concatenate([b["index"] for b in dmdask.batches(client, fast)])
        assert np.array_equal(np.sort(ids), np.arange(60))
        assert not os.path.exists(gate) and not any(got)  # A was blocked all along
        open(gate, "w").close()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert np.array_equal(np.sort(np.concatenate([i for g in got for i in g])), np.arange(N))


def test_zarr_sharded_array_blocks_are_its_inner_chunks(client, tmp_path):
    """A Zarr v3 array stored in shards of small inner chunks: blocks follow the inner
    chunks (so a cold batch waits for a few small range reads, not whole shards)."""
    import zarr

    values = np.arange(1000 * 8, dtype=np.float32).reshape(1000, 8)
    path = str(tmp_path / "sharded.zarr")
    zarr.create_array(path, shape=values.shape, chunks=(10, 8), shards=(500, 8), dtype="f4")[:] = values
    spec = dmdask.Spec(path, batch_size=64, seed=1)
    it = dmdask.batches(client, spec)
    assert (it.info.block_len, it.info.num_blocks) == (10, 100)
    batches = list(it)
    ids = np.concatenate([b["index"] for b in batches])
    assert np.array_equal(np.sort(ids), np.arange(1000))
    for b in batches:
        field = next(f for f in b if f != "index")
        np.testing.assert_array_equal(b[field], values[b["index"]])
