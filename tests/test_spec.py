"""Spec validation: every bad value names its field and the allowed range."""
import pickle

import pytest

import dmdask


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
