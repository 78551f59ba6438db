"""Weighted mixtures of sources (dmdask.Mix) on real worker processes: values, exact
counts, passes, determinism, resume and elastic resume, bad input."""
import concurrent.futures
import os
import pickle
import warnings

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.plan.mix import apportion

# sources of unequal sizes and chunks; value x of sample i of source s is s * 100_000 + i
SIZES = (300, 50, 1003)
CHUNKS = (32, 16, 64)


def write_source(path, n, tag, chunk, x_dtype="int64", x_shape=(2,), extra=None):
    import zarr

    group = zarr.open_group(path, mode="w")
    ids = np.arange(n)
    x = group.create_array("x", shape=(n,) + x_shape, chunks=(chunk,) + x_shape, dtype=x_dtype)
    x[:] = ((tag * 100_000 + ids).reshape((n,) + (1,) * len(x_shape)) * np.ones(x_shape)).astype(x_dtype)
    label = group.create_array("label", shape=(n,), chunks=(chunk,), dtype="int64")
    label[:] = ids % 10
    if extra:
        group.create_array(extra, shape=(n,), chunks=(chunk,), dtype="int64")[:] = ids
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(path)
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return [write_source(str(root / f"s{i}.zarr"), n, i, c) for i, (n, c) in enumerate(zip(SIZES, CHUNKS))]


def check_values(batches):
    """Every row is the sample its "source" and "index" name."""
    for b in batches:
        assert set(b) == {"x", "label", "source", "index"}
        assert b["source"].dtype == b["index"].dtype == np.int64
        np.testing.assert_array_equal(b["x"][:, 0], b["source"] * 100_000 + b["index"])
        np.testing.assert_array_equal(b["x"][:, 1], b["x"][:, 0])
        np.testing.assert_array_equal(b["label"], b["index"] % 10)
        assert (b["index"] < np.array(SIZES)[b["source"]]).all()


def run(client, spec, epoch=0, world=None, resume=None):
    """Every rank's batches (ranks in threads)."""
    world = world or spec.world_size

    def one(rank):
        return list(dmdask.batches(client, spec.replace(rank=rank, world_size=world), epoch=epoch, resume=resume))

    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


def in_epoch_order(per_rank):
    """(source, index) of each position of the epoch: rank r had positions r, r + world, ..."""
    world = len(per_rank)
    pairs = [np.stack([np.concatenate([b["source"] for b in bs]), np.concatenate([b["index"] for b in bs])], 1)
             for bs in per_rank]
    out = np.zeros((sum(len(p) for p in pairs), 2), dtype=np.int64)
    for rank, p in enumerate(pairs):
        out[rank::world] = p
    return out


def multiset(pairs):
    return sorted(map(tuple, np.asarray(pairs).tolist()))


# -- Mix and Spec, without a cluster ------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field,fragment", [
    (dict(weights=[1, -1, 1]), "weights", "finite numbers >= 0"),
    (dict(weights=[0, 0, 0]), "weights", "positive sum"),
    (dict(weights=[1, 2]), "weights", "3 finite numbers"),
    (dict(weights=[1, float("nan"), 1]), "weights", "finite"),
    (dict(weights=[1, True, 1]), "weights", "finite"),
    (dict(weights="111"), "weights", "finite"),
    (dict(epoch_size=0), "epoch_size", "epoch_size=0"),
    (dict(epoch_size=2.0), "epoch_size", "epoch_size=2.0"),
])
def test_bad_weights_and_epoch_sizes_name_the_field(kwargs, field, fragment):
    with pytest.raises(dmdask.SpecError) as info:
        dmdask.Mix(["a.zarr", "b.zarr", "c.zarr"], **kwargs)
    assert info.value.field == field and fragment in str(info.value)


def test_bad_source_lists():
    for bad in ([], "a.zarr", [""], [dmdask.Mix(["a.zarr"])], [dmdask.Spec("a.zarr", 4, transform=len)],
                [dmdask.Spec(dmdask.Mix(["a.zarr"]), 4)]):
        with pytest.raises(dmdask.SpecError) as info:
            dmdask.Mix(bad)
        assert info.value.field == "source"
    with pytest.raises(dmdask.SpecError, match="'source'") as info:
        dmdask.Spec(dmdask.Mix(["a.zarr", "b.zarr"]), 4, keys=["x", "source"])
    assert info.value.field == "keys"
    # a list of strings in Spec.source still means the shards of one WebDataset source
    assert dmdask.Spec(["a.tar", "b.tar"], 4).source == (os.path.abspath("a.tar"), os.path.abspath("b.tar"))


def test_a_mixture_spec_is_frozen_and_picklable_and_splits_into_one_spec_per_source():
    import pathlib

    mix = dmdask.Mix([pathlib.Path("a.zarr"), ["s-0.tar", "s-1.tar"],
                      dmdask.Spec("c.zarr", 1, keys=["x"], block_size=128, storage_options={"anon": True})],
                     weights=np.array([1, 2.5, 0]), epoch_size=np.int64(100))
    a_zarr, shards = os.path.abspath("a.zarr"), (os.path.abspath("s-0.tar"), os.path.abspath("s-1.tar"))
    assert mix.sources[:2] == (a_zarr, shards) and mix.weights == (1, 2.5, 0.0)
    assert type(mix.epoch_size) is int
    spec = dmdask.Spec(mix, 16, seed=3, keys=["x", "label"], transform=len)
    assert pickle.loads(pickle.dumps(spec.replace(transform=None))) == spec.replace(transform=None)
    a, b, c = mix.specs(spec)
    assert (a.source, a.keys, a.seed, a.transform) == (a_zarr, ("x", "label"), 3, None)
    assert b.source == shards
    assert (c.source, c.keys, c.block_size, c.storage_options) == (os.path.abspath("c.zarr"), ("x",), 128,
                                                                   {"anon": True})


# -- on a cluster --------------------------------------------------------------------------------

def test_an_epoch_has_exact_counts_values_of_the_sources_and_passes(client, sources):
    """Three ranks read a mixture epoch: each position once (the positions the order
    gives), each source exactly its share, every value that of its sample; the small
    source is drawn 6.76 times its size: each of its samples 6 or 7 times (passes)."""
    weights = [2, 1, 1]
    spec = dmdask.Spec(dmdask.Mix(sources, weights=weights), batch_size=50, seed=5)
    n = sum(SIZES)
    counts = apportion(n, weights)
    for epoch in (0, 1):  # epoch 1 is warm: the rows straight from this host's arenas
        per_rank = run(client, spec, epoch=epoch, world=3)
        for batches in per_rank:
            check_values(batches)
        pairs = in_epoch_order(per_rank)
        assert len(pairs) == n
        assert np.bincount(pairs[:, 0]).tolist() == counts
        it = dmdask.batches(client, spec, epoch=epoch)
        order = it.info.order(shuffle=spec.shuffle, seed=spec.seed, epoch=epoch, shuffle_window=spec.shuffle_window)
        expected = np.stack(it.info.split(order.ids(np.arange(n))), axis=1)
        it.close()
        assert np.array_equal(pairs, expected)  # rank r got positions r, r + 3, ...
        times = np.bincount(pairs[pairs[:, 0] == 1, 1], minlength=SIZES[1])
        if epoch == 0:  # passes 0-5 whole, then the first 38 samples of pass 6
            assert np.bincount(times).tolist() == [0] * 6 + [12, 38]
        else:  # the rest of pass 6, passes 7-12, the start of pass 13
            assert times.sum() == counts[1] and times.max() - times.min() <= 2
    it = dmdask.batches(client, spec.replace(rank=2, world_size=3), epoch=1)
    warm = list(it)
    assert it.requests == 0  # every block of every source in an arena on this host: no request at all
    check_values(warm)
    for a, b in zip(warm, per_rank[2]):
        np.testing.assert_array_equal(a["source"], b["source"])
        np.testing.assert_array_equal(a["index"], b["index"])


def test_the_weights_hold_batch_by_batch(client, sources):
    """Over an epoch each source gets exactly its share; batch by batch, the counts
    stay within chance of the weights (chi-square over all batches, p = 0.001)."""
    weights = [0.5, 0.2, 0.3]
    spec = dmdask.Spec(dmdask.Mix(sources, weights=weights, epoch_size=5000), batch_size=100, seed=9)
    batches = list(dmdask.batches(client, spec))
    assert len(batches) == 50
    check_values(batches)
    counts = np.array([np.bincount(b["source"], minlength=3) for b in batches])
    assert counts.sum(axis=0).tolist() == apportion(5000, weights)
    expected = 100 * np.array(weights)
    chi_square = ((counts - expected) ** 2 / expected).sum()
    assert chi_square < 149.4  # chi-square table, 100 degrees of freedom, p = 0.001


def test_same_seed_and_epoch_same_batches_other_epochs_and_seeds_differ(client, sources):
    spec = dmdask.Spec(dmdask.Mix(sources, weights=[1, 1, 1]), batch_size=64, seed=2, rank=1, world_size=2)

    def pairs(s, epoch, on=client):
        return np.concatenate([np.stack([b["source"], b["index"]], 1) for b in dmdask.batches(on, s, epoch)])

    first = pairs(spec, 3)
    assert np.array_equal(first, pairs(spec, 3))
    assert not np.array_equal(first, pairs(spec, 4))
    assert not np.array_equal(first, pairs(spec.replace(seed=3), 3))
    with dmdask.LocalCluster(n_workers=1, ram="1 MiB") as cluster, distributed.Client(cluster) as other:
        assert np.array_equal(first, pairs(spec, 3, on=other))  # nothing depends on the cluster


def test_resume_a_mixture_mid_epoch(client, sources):
    spec = dmdask.Spec(dmdask.Mix(sources, weights=[3, 1, 1]), batch_size=30, seed=7, rank=1, world_size=2,
                       prefetch=4)
    full = list(dmdask.batches(client, spec, epoch=2))
    it = dmdask.batches(client, spec, epoch=2)
    first = [next(it) for _ in range(5)]
    state = it.state_dict()
    it.close()
    assert state["identity"].startswith("mix-")
    rest = list(dmdask.batches(client, spec, epoch=2, resume=state))
    assert len(first) + len(rest) == len(full)
    for a, b in zip(first + rest, full):
        for name in ("source", "index", "x"):
            np.testing.assert_array_equal(a[name], b[name])
    with pytest.raises(dmdask.SpecError, match="identity"):  # another mixture: other counts
        dmdask.batches(client, spec.replace(source=dmdask.Mix(sources, weights=[1, 1, 1])), epoch=2, resume=state)


def test_elastic_resume_of_a_mixture_from_three_ranks_to_two(client, sources):
    """Three ranks stop part-way, two go on: together they deliver the uninterrupted
    epoch's positions, each once."""
    spec = dmdask.Spec(dmdask.Mix(sources, weights=[1, 2, 1]), batch_size=16, seed=4, prefetch=4)
    full = multiset(in_epoch_order(run(client, spec, epoch=1, world=3)))
    delivered, states = [], []
    for rank in range(3):
        it = dmdask.batches(client, spec.replace(rank=rank, world_size=3), epoch=1)
        delivered += [next(it) for _ in range(3 + rank)]
        states.append(it.state_dict())
        it.close()
    for rank in range(2):
        delivered += list(dmdask.batches(client, spec.replace(rank=rank, world_size=2), epoch=1, resume=states))
    check_values(delivered)
    pairs = np.concatenate([np.stack([b["source"], b["index"]], 1) for b in delivered])
    assert multiset(pairs) == full and len(pairs) == sum(SIZES)


def identity_transform(batch):
    ctx = dmdask.transform_context()
    return dict(batch, epoch=np.full(len(batch["index"]), ctx.epoch))


def test_a_transform_sees_the_mixed_batches_with_their_sources(client, sources):
    spec = dmdask.Spec(dmdask.Mix(sources[:2], weights=[1, 1], epoch_size=400), batch_size=64, seed=1,
                       transform=identity_transform)
    batches = list(dmdask.batches(client, spec, epoch=5))
    assert all((b.pop("epoch") == 5).all() for b in batches)
    check_values(batches)
    assert np.bincount(np.concatenate([b["source"] for b in batches])).tolist() == [200, 200]


def test_sources_as_specs_with_keys_of_their_own_and_release(client, sources, tmp_path):
    """A source with an extra array joins with keys of its own; a zero weight leaves a
    source out; release drops every source of the mixture."""
    extra = write_source(str(tmp_path / "extra.zarr"), 70, 3, 8, extra="weight")
    mix = dmdask.Mix([sources[0], dmdask.Spec(extra, 1, keys=["x", "label"]), sources[1]], weights=[1, 1, 0])
    spec = dmdask.Spec(mix, batch_size=40)
    batches = list(dmdask.batches(client, spec))
    assert sorted(np.unique(np.concatenate([b["source"] for b in batches])).tolist()) == [0, 1]
    for b in batches:
        tags = np.array([0, 3, 1])[b["source"]]
        np.testing.assert_array_equal(b["x"][:, 0], tags * 100_000 + b["index"])
    from dmdask.source import dataset_name

    names = {dataset_name(s) for s in mix.specs(spec)}
    assert names <= {d["name"] for d in dmdask.stats(client)["datasets"]}  # a dataset per source
    assert dmdask.release(client, spec) is True
    assert not names & {d["name"] for d in dmdask.stats(client)["datasets"]}


def test_sources_with_other_fields_are_refused_before_any_batch(client, sources, tmp_path):
    other_names = write_source(str(tmp_path / "names.zarr"), 40, 4, 8, extra="weight")
    with pytest.raises(dmdask.SpecError, match="same fields") as info:
        dmdask.batches(client, dmdask.Spec(dmdask.Mix([sources[0], other_names]), batch_size=8))
    assert info.value.field == "keys"
    floats = write_source(str(tmp_path / "floats.zarr"), 40, 5, 8, x_dtype="float32")
    with pytest.raises(dmdask.SpecError, match="'x' is int64 .* but float32"):
        dmdask.batches(client, dmdask.Spec(dmdask.Mix([sources[0], floats]), batch_size=8))
    wide = write_source(str(tmp_path / "wide.zarr"), 40, 6, 8, x_shape=(3,))
    with pytest.raises(dmdask.SpecError, match=r"sample shape \(2,\) .* \(3,\)"):
        dmdask.batches(client, dmdask.Spec(dmdask.Mix([sources[0], wide]), batch_size=8))
    # the common fields chosen with keys= mix fine
    ok = dmdask.Spec(dmdask.Mix([sources[0], floats]), batch_size=8, keys=["label"])
    assert next(iter(dmdask.batches(client, ok)))["label"].dtype == np.int64
    with pytest.raises(dmdask.SpecError, match="there twice"):
        dmdask.batches(client, dmdask.Spec(dmdask.Mix([sources[0], sources[1], sources[0]]), batch_size=8))
    named = write_source(str(tmp_path / "named.zarr"), 40, 7, 8, extra="source")
    with pytest.raises(dmdask.SpecError, match="'source'"):
        dmdask.batches(client, dmdask.Spec(dmdask.Mix([named]), batch_size=8))


def test_a_missing_source_fails_the_concurrent_opens_naming_it_and_the_others_stay_usable(client, sources, tmp_path):
    """The sources of a mixture are opened at once (`open_datasets`): one that does not exist
    is a `SourceNotFoundError` naming it, raised once every open ended; the sources opened
    beside it were registered and read afterwards as usual."""
    missing = str(tmp_path / "nowhere.zarr")
    with pytest.raises(dmdask.SourceNotFoundError, match="nowhere.zarr"):
        dmdask.batches(client, dmdask.Spec(dmdask.Mix([sources[0], missing, sources[2]]), batch_size=8))
    spec = dmdask.Spec(dmdask.Mix([sources[0], sources[2]]), batch_size=64, seed=5)
    drawn = [(s, i) for b in dmdask.batches(client, spec) for s, i in zip(b["source"].tolist(), b["index"].tolist())]
    assert sorted(drawn) == [(s, i) for s, n in enumerate((SIZES[0], SIZES[2])) for i in range(n)]
