"""Spec validation: every bad value names its field and the allowed range."""
import pickle

import numpy as np
import pytest

import dmdask
from dmdask.testing.datasets import write_zarr


@pytest.mark.parametrize("field,value,fragment", [
    ("batch_size", 0, "batch_size=0"),
    ("batch_size", 2.5, "batch_size=2.5"),
    ("rank", 3, "0 <= rank < world_size=2"),
    ("world_size", 0, "world_size=0"),
    ("prefetch", 0, "prefetch=0"),
    ("shuffle_window", 0, "shuffle_window=0"),
    ("block_size", -1, "block_size=-1"),
    ("shuffle", "yes", "shuffle='yes'"),
    ("keys", "x", "keys='x'"),
    ("keys", ["index"], "reserved name 'index'"),
    ("transform", 5, "transform=5"),
    ("source", "", "source=''"),
])
def test_bad_values_name_the_field(field, value, fragment):
    kwargs = {"source": "data.zarr", "batch_size": 4, "world_size": 2}
    kwargs[field] = value
    with pytest.raises(ValueError, match=None) as info:
        dmdask.Spec(**kwargs)
    assert isinstance(info.value, dmdask.SpecError)
    assert info.value.field == field
    assert fragment in str(info.value)


def test_unpicklable_transform_is_refused_up_front():
    import threading

    lock = threading.Lock()
    with pytest.raises(dmdask.SpecError, match="picklable"):
        dmdask.Spec("d.zarr", 4, transform=lambda b, lock=lock: b)


def identity(sample):
    return sample


def test_spec_is_frozen_and_picklable():
    import dataclasses

    import cloudpickle

    spec = dmdask.Spec("d.zarr", 8, keys=["x"], transform=dmdask.per_sample(identity))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.batch_size = 3
    again = pickle.loads(pickle.dumps(spec))
    assert again.batch_size == 8 and again.keys == ("x",)
    assert again.transform.fn is identity
    with_lambda = pickle.loads(cloudpickle.dumps(spec.replace(transform=lambda b: b)))
    assert with_lambda.transform({"a": 1}) == {"a": 1}
    assert spec.replace(rank=1, world_size=2).rank == 1


NUMPY_INTS = {"batch_size": np.int64(8), "seed": np.uint32(3), "rank": np.int32(1), "world_size": np.int64(2),
              "prefetch": np.int16(4), "shuffle_window": np.uint8(2), "block_size": np.int64(64)}


def test_numpy_integers_are_stored_as_int():
    spec = dmdask.Spec("d.zarr", **NUMPY_INTS)
    for name, value in NUMPY_INTS.items():
        assert type(getattr(spec, name)) is int and getattr(spec, name) == int(value), name
    assert spec == dmdask.Spec("d.zarr", **{k: int(v) for k, v in NUMPY_INTS.items()})
    assert type(spec.replace(batch_size=np.int8(3)).batch_size) is int


@pytest.mark.parametrize("value", [True, np.True_, 8.0, np.float64(8.0), np.float32(2), "8"])
@pytest.mark.parametrize("field", ["batch_size", "seed", "rank", "world_size", "prefetch", "shuffle_window",
                                   "block_size"])
def test_bools_floats_and_strings_are_still_refused(field, value):
    kwargs = {"source": "d.zarr", "batch_size": 4, "world_size": 2, field: value}
    with pytest.raises(dmdask.SpecError) as info:
        dmdask.Spec(**kwargs)
    assert info.value.field == field and f"{field}={value!r}" in str(info.value)


def test_batches_take_numpy_integers_for_epoch_and_resume(client, tmp_path):
    path = write_zarr(str(tmp_path / "d.zarr"), 300, chunk=50)
    plain = dmdask.Spec(path, batch_size=16, seed=5, rank=1, world_size=2)
    spec = dmdask.Spec(path, batch_size=np.int64(16), seed=np.int64(5), rank=np.int64(1), world_size=np.int64(2))
    full = [b["index"] for b in dmdask.batches(client, plain, epoch=2)]
    it = dmdask.batches(client, spec, epoch=np.int64(2))
    assert it.epoch == 2 and type(it.epoch) is int
    first = [next(it)["index"] for _ in range(3)]
    # a state whose values came back as numpy scalars (say, from np.savez or a tensor)
    state = {k: np.int64(v) if type(v) is int else v for k, v in it.state_dict().items()}
    it.close()
    rest = [b["index"] for b in dmdask.batches(client, spec, epoch=np.uint8(2), resume=state)]
    assert len(first + rest) == len(full)
    for a, b in zip(first + rest, full):
        np.testing.assert_array_equal(a, b)
    for bad in (True, 2.0, np.float64(2)):
        with pytest.raises(dmdask.SpecError, match="epoch=") as info:
            dmdask.batches(client, spec, epoch=bad)
        assert info.value.field == "epoch"


def test_a_misspelt_field_names_the_nearest_one():
    with pytest.raises(TypeError, match="'batchsize'; did you mean 'batch_size'"):
        dmdask.Spec("/data/x.zarr", batchsize=32)
    with pytest.raises(TypeError, match="the fields are"):
        dmdask.Spec("/data/x.zarr", 32, zzz=1)
