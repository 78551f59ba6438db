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
from benchmarks.common import write_files


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


def test_warm_windows_taken_whole_from_this_hosts_arenas_are_numpys_slices(tmp_path, client):
    """A warm epoch on the workers' host (no request: every window taken from the arenas,
    `LocalArenas.take_windows`): each window is exactly numpy's slice of the same tokens,
    those that cross into a block in the other worker's arena included, every window once;
    for a corpus and for a blend of it with another."""
    from dmdask.client.arenas import LocalArenas

    corpora = [str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")]
    tokens = [write_tokens(corpora[0], 6000, chunk=256), write_tokens(corpora[1], 2000, chunk=256) + 1]
    zarr.open_group(corpora[1], mode="r+")["tokens"][:] = tokens[1]
    window = dmdask.Window(100, stride=99)
    single = dmdask.Spec(corpora[0], batch_size=8, seed=3, window=window)
    blend = dmdask.Spec(dmdask.Mix(corpora), batch_size=8, seed=3, window=window)
    for spec, sources in ((single, [0]), (blend, [0, 1])):
        for _ in dmdask.batches(client, spec, epoch=0):  # every block loaded, in both workers
            pass
        warm, seen = dmdask.batches(client, spec, epoch=1), []
        for batch in warm:
            assert batch["tokens"].shape == (len(batch["index"]), 100)
            origins = batch.get("source", np.zeros(len(batch["index"]), dtype=np.int64)).tolist()
            for s, w, row in zip(origins, batch["index"].tolist(), batch["tokens"]):
                np.testing.assert_array_equal(row, tokens[s][w * 99:w * 99 + 100])
                seen.append((s, w))
        assert warm.requests == 0  # the same-host path, every batch
        assert sorted(seen) == [(s, w) for s in sources for w in range(window.count(len(tokens[s])))]
    arena_of = LocalArenas.of(warm.info.sources[0]).arena_of  # where corpus 0's blocks are
    starts = np.arange(window.count(6000)) * 99
    first, last = arena_of[starts // 256], arena_of[(starts + 99) // 256]
    assert (first != last).any() and (first == last).any()  # windows across two arenas, and within one


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


def write_xarray(path: str, steps: int, chunk: int):
    """An xarray Dataset (time, lat, lon) written to Zarr v3 by xarray: two variables, a
    datetime "time" coordinate (CF units) and static "lat"/"lon" coordinates."""
    import pandas as pd
    import xarray as xr

    shape = (steps, 3, 4)
    ds = xr.Dataset({"t2m": (("time", "lat", "lon"), np.arange(np.prod(shape), dtype=np.float32).reshape(shape)),
                     "u10": (("time", "lat", "lon"), -np.arange(np.prod(shape), dtype=np.float64).reshape(shape))},
                    coords={"time": pd.date_range("2020-01-01", periods=steps, freq="6h"),
                            "lat": [-45.0, 0.0, 45.0], "lon": [0.0, 90.0, 180.0, 270.0]})
    ds.chunk({"time": chunk}).to_zarr(path, zarr_format=3, consolidated=False)
    return ds


def test_xarray_time_windows_carry_their_times_across_two_ranks(tmp_path, client):
    """`Window(dim="time")` on an xarray-written Zarr: the fields are the arrays along time
    (both variables and the time coordinate, decoded to datetime64), each window equals
    xarray's own `isel(time=...)` of it, and two ranks share every window once."""
    path = str(tmp_path / "era.zarr")
    ds = write_xarray(path, 150, chunk=16)
    window = dmdask.Window(8, stride=4, dim="time")
    seen = []
    for rank in (0, 1):
        spec = dmdask.Spec(path, batch_size=6, seed=1, rank=rank, world_size=2, window=window)
        for batch in dmdask.batches(client, spec):
            assert sorted(batch) == ["index", "t2m", "time", "u10"]  # lat/lon are not along time
            assert batch["time"].dtype == np.dtype("datetime64[ns]")
            for w, t2m, u10, times in zip(batch["index"].tolist(), batch["t2m"], batch["u10"], batch["time"]):
                expected = ds.isel(time=slice(w * 4, w * 4 + 8))
                np.testing.assert_array_equal(t2m, expected["t2m"].values)
                np.testing.assert_array_equal(u10, expected["u10"].values)
                np.testing.assert_array_equal(times, expected["time"].values)
            seen += batch["index"].tolist()
    assert sorted(seen) == list(range((150 - 8) // 4 + 1))
    warm = dmdask.batches(client, dmdask.Spec(path, batch_size=6, seed=1, window=window), epoch=1)
    for batch in warm:  # every block held on this host: windows taken from the arenas a run at a time
        for w, t2m, times in zip(batch["index"].tolist(), batch["t2m"], batch["time"]):
            np.testing.assert_array_equal(t2m, ds["t2m"].values[w * 4:w * 4 + 8])
            np.testing.assert_array_equal(times, ds["time"].values[w * 4:w * 4 + 8])
    assert warm.requests == 0  # no request: the same-host path


def test_a_window_dim_that_cannot_be_read_is_a_spec_error_naming_the_fix(tmp_path, client):
    import xarray as xr

    path = str(tmp_path / "era.zarr")
    ds = write_xarray(path, 40, chunk=8)
    with pytest.raises(dmdask.SpecError, match="one of .'lat', 'lon', 'time'."):  # no such dimension
        next(iter(dmdask.batches(client, dmdask.Spec(path, batch_size=2, window=dmdask.Window(4, dim="step")))))
    with pytest.raises(dmdask.SpecError, match="Spec.keys="):  # a coordinate chosen that is not along time
        next(iter(dmdask.batches(client, dmdask.Spec(path, batch_size=2, keys=["t2m", "lat"],
                                                     window=dmdask.Window(4, dim="time")))))
    lon_first = str(tmp_path / "transposed.zarr")
    xr.Dataset({"v": ds["t2m"].transpose("lon", "time", "lat")}).to_zarr(lon_first, zarr_format=3, consolidated=False)
    with pytest.raises(dmdask.SpecError, match=r"v has \('lon', 'time', 'lat'\).*transpose\('time'"):
        next(iter(dmdask.batches(client, dmdask.Spec(lon_first, batch_size=2, window=dmdask.Window(4, dim="time")))))
    plain = str(tmp_path / "tokens.zarr")
    write_tokens(plain, 100, chunk=10)  # arrays that name no dimensions
    with pytest.raises(dmdask.SpecError, match="do not name their dimensions"):
        next(iter(dmdask.batches(client, dmdask.Spec(plain, batch_size=2, window=dmdask.Window(4, dim="time")))))
    folder = str(tmp_path / "files")
    write_files(folder, 20, 64)
    with pytest.raises(dmdask.SpecError, match="this source is not Zarr"):
        next(iter(dmdask.batches(client, dmdask.Spec(folder, batch_size=2, window=dmdask.Window(4, dim="time")))))
    with pytest.raises(dmdask.SpecError, match="window"):
        dmdask.Window(4, dim="")


def test_a_blend_of_three_corpora_deals_their_windows_by_weight_exactly_once(tmp_path, client):
    """`Mix` of three token corpora with a window: unweighted, two ranks get every window of
    every source once, each the source's own tokens; weighted, each source gets exactly its
    apportioned count of distinct windows."""
    corpora = [str(tmp_path / f"c{i}.zarr") for i in range(3)]
    tokens = [write_tokens(path, n, chunk=64) for path, n in zip(corpora, (700, 1300, 333))]
    for i, t in enumerate(tokens):  # tell the corpora apart
        zarr.open_group(corpora[i], mode="r+")["tokens"][:] = (t + 1000 * i).astype(np.uint16)
        tokens[i] = (t + 1000 * i).astype(np.uint16)
    window = dmdask.Window(17, stride=16)
    counts = [window.count(len(t)) for t in tokens]
    seen = []
    for rank in (0, 1):
        spec = dmdask.Spec(dmdask.Mix(corpora), batch_size=5, seed=4, rank=rank, world_size=2, window=window)
        for batch in dmdask.batches(client, spec):
            assert batch["tokens"].shape == (len(batch["index"]), 17) and batch["source"].shape == batch["index"].shape
            for s, w, row in zip(batch["source"].tolist(), batch["index"].tolist(), batch["tokens"]):
                np.testing.assert_array_equal(row, tokens[s][w * 16:w * 16 + 17])
                seen.append((s, w))
    assert sorted(seen) == [(s, w) for s in range(3) for w in range(counts[s])]
    weighted = dmdask.Spec(dmdask.Mix(corpora, weights=[3, 0, 1], epoch_size=40), batch_size=8, seed=1, window=window)
    drawn = [(s, w) for b in dmdask.batches(client, weighted) for s, w in zip(b["source"].tolist(), b["index"].tolist())]
    assert len(drawn) == len(set(drawn)) == 40
    assert [sum(s == i for s, _ in drawn) for i in range(3)] == [30, 0, 10]
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
    with pytest.raises(dmdask.SpecError, match="transform"):
        dmdask.Spec("x.zarr", batch_size=2, window=dmdask.Window(4), transform=dict)


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
