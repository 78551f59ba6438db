"""Window samples (`dmdask.Window`) on real worker processes: a sample is `length`
consecutive rows of every field; every window of an epoch goes to exactly one rank, its
rows are the source's rows in order, and an epoch stopped at one world size resumes at
another with exactly the windows not yet delivered."""
import hashlib

import distributed
import numpy as np
import pytest
import zarr

import dmdask


def write_tokens(path: str, n: int, chunk: int) -> np.ndarray:
    """A Zarr v3 group with "tokens": uint16 token ids laid end to end (a 1-D array)."""
    tokens = (np.arange(n, dtype=np.int64) * 7919 % 50257).astype(np.uint16)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("tokens", shape=(n,), chunks=(chunk,), dtype="uint16")[:] = tokens
    return tokens


def write_fields(path: str, steps: int, chunk: int) -> np.ndarray:
    """A Zarr v3 group with "t2m": float32 (time, lat, lon), a step's values unique."""
    values = np.arange(steps * 4 * 5, dtype=np.float32).reshape(steps, 4, 5)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("t2m", shape=values.shape, chunks=(chunk, 4, 5), dtype="float32")[:] = values
    return values


@pytest.fixture(scope="module")
def client():
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        yield client


def test_token_windows_go_once_to_one_rank_each_with_its_rows(tmp_path, client):
    tokens = write_tokens(str(tmp_path / "corpus.zarr"), 1000, chunk=64)
    window = dmdask.Window(17, stride=16)  # sequence length 16 and its next token
    count = (1000 - 17) // 16 + 1
    for epoch in (0, 1):
        delivered, orders = [], []
        for rank in range(3):
            spec = dmdask.Spec(str(tmp_path / "corpus.zarr"), batch_size=8, seed=1, rank=rank, world_size=3,
                               window=window)
            for batch in dmdask.batches(client, spec, epoch=epoch):
                assert batch["tokens"].shape == (len(batch["index"]), 17)
                for w, row in zip(batch["index"].tolist(), batch["tokens"]):
                    np.testing.assert_array_equal(row, tokens[w * 16:w * 16 + 17])
                delivered.append(batch["index"])
            orders.append(np.concatenate(delivered))
        ids = np.concatenate(delivered)
        assert sorted(ids.tolist()) == list(range(count))  # every window once, none partial
        assert not np.array_equal(ids, np.sort(ids))  # shuffled


def test_time_windows_of_a_field_keep_their_shape(tmp_path, client):
    values = write_fields(str(tmp_path / "weather.zarr"), 200, chunk=16)
    spec = dmdask.Spec(str(tmp_path / "weather.zarr"), batch_size=10, seed=2, window=dmdask.Window(4, stride=1))
    seen = []
    for batch in dmdask.batches(client, spec):
        assert batch["t2m"].shape == (len(batch["index"]), 4, 4, 5)
        for w, steps in zip(batch["index"].tolist(), batch["t2m"]):
            np.testing.assert_array_equal(steps, values[w:w + 4])
        seen += batch["index"].tolist()
    assert sorted(seen) == list(range(197))


def test_windows_stopped_at_three_ranks_resume_at_two_exactly_once(tmp_path, client):
    write_tokens(str(tmp_path / "corpus.zarr"), 2000, chunk=64)
    window = dmdask.Window(33, stride=32)
    count = (2000 - 33) // 32 + 1

    def spec(rank, world):
        return dmdask.Spec(str(tmp_path / "corpus.zarr"), batch_size=4, seed=5, rank=rank, world_size=world,
                           window=window)

    before, states = [], []
    for rank in range(3):
        it = dmdask.batches(client, spec(rank, 3), epoch=2)
        for _ in range(rank + 1):  # ranks stop at different points
            before += next(it)["index"].tolist()
        states.append(it.state_dict())
        it.close()
    after = []
    for rank in range(2):
        after += [w for b in dmdask.batches(client, spec(rank, 2), epoch=2, resume=states) for w in b["index"].tolist()]
    assert sorted(before + after) == list(range(count))
    with pytest.raises(dmdask.SpecError, match="window"):  # a state of other windows is refused
        other = dmdask.Spec(str(tmp_path / "corpus.zarr"), batch_size=4, seed=5, window=dmdask.Window(32))
        dmdask.batches(client, other, epoch=2, resume=states[0])


def multiset_hash(ids) -> str:
    """A hash of window ids as a multiset (sorted, int64): equal for two streams that hold the same ids
    the same number of times, in any order."""
    return hashlib.sha256(np.sort(np.asarray(ids, dtype=np.int64)).tobytes()).hexdigest()


def test_windows_saved_at_8_ranks_resumed_at_6_then_5_hash_as_an_uninterrupted_run(tmp_path, client):
    """The language-model resume of issue 40: a run saved at 8 ranks, resumed at 6 (from the 8
    states), saved again and resumed at 5 (from the 6 states) consumes, per epoch, the same
    multiset of windows as an uninterrupted run at 8 ranks: every window exactly once."""
    tokens = write_tokens(str(tmp_path / "corpus.zarr"), 4000, chunk=64)
    window = dmdask.Window(33, stride=32)
    count = window.count(4000)

    def spec(rank, world):
        return dmdask.Spec(str(tmp_path / "corpus.zarr"), batch_size=2, seed=11, rank=rank, world_size=world,
                           window=window)

    def consumed(batches):
        out = []
        for batch in batches:
            for w, row in zip(batch["index"].tolist(), batch["tokens"]):
                np.testing.assert_array_equal(row, tokens[w * 32:w * 32 + 33])
            out += batch["index"].tolist()
        return out

    def stopped(world, resume, steps):
        """Each rank of `world` takes steps(rank) batches (resumed from `resume`), then saves."""
        ids, states = [], []
        for rank in range(world):
            it = dmdask.batches(client, spec(rank, world), epoch=3, resume=resume)
            ids += consumed(next(it) for _ in range(steps(rank)))
            states.append(it.state_dict())
            it.close()
        return ids, states

    expected = {epoch: [w for r in range(8) for w in consumed(dmdask.batches(client, spec(r, 8), epoch=epoch))]
                for epoch in (3, 4)}
    at_8, states_8 = stopped(8, None, lambda rank: 1 + rank % 3)
    at_6, states_6 = stopped(6, states_8, lambda rank: 1 + rank % 2)
    at_5 = [w for r in range(5) for w in consumed(dmdask.batches(client, spec(r, 5), epoch=3, resume=states_6))]
    assert all(s["world_size"] == 6 and [g["world_size"] for g in s["history"]] == [8] for s in states_6)
    assert at_8 and at_6 and at_5
    resumed = {3: at_8 + at_6 + at_5,
               4: [w for r in range(5) for w in consumed(dmdask.batches(client, spec(r, 5), epoch=4))]}
    for epoch in (3, 4):
        assert sorted(resumed[epoch]) == sorted(expected[epoch]) == list(range(count))  # each window once
        assert multiset_hash(resumed[epoch]) == multiset_hash(expected[epoch])


def test_bad_windows_are_spec_errors_naming_the_window():
    for bad in (dict(length=0), dict(length=4, stride=0), dict(length=2.0)):
        with pytest.raises(dmdask.SpecError, match="window"):
            dmdask.Window(**bad)
    with pytest.raises(dmdask.SpecError, match="window"):
        dmdask.Spec("x.zarr", batch_size=2, window=(4, 2))
    with pytest.raises(dmdask.SpecError, match="window"):
        dmdask.Spec("x.zarr", batch_size=2, window=dmdask.Window(4), shuffle_window=2)


def test_blocks_load_in_the_order_the_windows_of_the_epoch_need_them():
    """The claimant submits a windowed dataset's blocks in the order its windows first need
    them (`load_order`), not in the order of a row epoch: the blocks of the first batches'
    windows load first (a window's rows may span 3 blocks here)."""
    from dmdask.plan.order import EpochOrder, load_order
    from dmdask.source.base import DatasetInfo

    info = DatasetInfo(name="ds-x", identity="x", url="u", fields=("tokens",), num_samples=100_000, block_len=500,
                       nbytes=None)
    spec = dmdask.Spec("u.zarr", batch_size=4, seed=3, window=dmdask.Window(1025, stride=1024))
    windows = EpochOrder(spec.window.count(info.num_samples), 1, shuffle=True, seed=3, epoch=2)
    expected = []
    for w in windows.ids(np.arange(40)):  # brute force: each window's rows' blocks, first need first
        expected += [b for b in range(w * 1024 // 500, (w * 1024 + 1024) // 500 + 1) if b not in expected]
    expected += [b for b in range(info.num_blocks) if b not in expected]
    order = load_order(info, spec, epoch=2, limit=40)
    assert order.tolist() == expected
    assert not np.array_equal(order, load_order(info, spec.replace(window=None), epoch=2, limit=40))
    assert load_order(info, spec.replace(shuffle=False), epoch=2, limit=40).tolist() == list(range(200))
