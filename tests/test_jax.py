"""Tests for dmdask.integrations.jax (JaxLoader) on a real two-worker dmdask cluster.

Runs in the main environment (CPU jax/jaxlib). JAX is given four CPU devices here, so
that sharding a batch over local devices is real.
"""

from __future__ import annotations

import json
import pickle

import distributed
import numpy as np
import pytest
import zarr

jax = pytest.importorskip("jax", reason="JAX is not installed in this environment (`make test` installs it in .venv)")

try:  # before JAX starts its backend: four CPU devices for the sharding tests
    jax.config.update("jax_num_cpu_devices", 4)
except (AttributeError, RuntimeError):  # an older JAX, or a backend some other module started
    pass

import jax.numpy as jnp  # noqa: E402
from framework_cases import (  # noqa: E402
    FEATURES,
    N,
    assert_accurate,
    assert_loss_falls,
    assert_resumed,
    check_elastic_resume,
    check_exactly_once,
    check_folder_batches,
    check_other_epoch_and_spec,
    env_fixture,
    folder_spec,
    imported_modules,
    take,
    zarr_spec,
)
from jax.sharding import NamedSharding  # noqa: E402

import dmdask  # noqa: E402
from dmdask.integrations.jax import (  # noqa: E402
    JaxLoader,
    local_batch_sharding,
    process_spec,
    to_jax,
)

env = env_fixture("jaxdata")
_spec = zarr_spec


# --- without a cluster -------------------------------------------------------------------

def test_module_imports_no_other_framework():
    imported = imported_modules("dmdask/integrations/jax.py")
    assert "jax" in imported and not {"torch", "tensorflow", "mxnet"} & imported


def test_to_jax_types():
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.frombuffer(b"abc", dtype=np.uint8), np.frombuffer(b"de", dtype=np.uint8)]
    out = to_jax({"x": np.arange(6, dtype="f4").reshape(3, 2), "big": np.arange(3, dtype=">f4"),
                  "b": np.array([True, False, True]), "data": ragged, "s": np.array(["a", "b", "c"]),
                  "index": np.arange(3, dtype="i4")})
    assert isinstance(out["x"], jax.Array) and out["x"].dtype == jnp.float32 and out["x"].shape == (3, 2)
    assert out["big"].dtype == jnp.float32 and out["big"].tolist() == [0.0, 1.0, 2.0]
    assert out["b"].dtype == jnp.bool_
    assert [bytes(np.asarray(a)) for a in out["data"]] == [b"abc", b"de"]
    assert isinstance(out["s"], np.ndarray)
    assert isinstance(out["index"], np.ndarray) and out["index"].dtype == np.int64


def test_rank_and_world_size_from_jax(monkeypatch):
    spec = dmdask.Spec(source="unused", batch_size=4, rank=1, world_size=3)
    assert process_spec(spec) is spec  # one process: the spec decides
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    adopted = process_spec(dmdask.Spec(source="unused", batch_size=4))
    assert (adopted.rank, adopted.world_size) == (2, 3)
    with pytest.raises(ValueError, match="rank=1, world_size=3"):
        process_spec(spec)


def test_sharding_needs_even_batches():
    if len(jax.local_devices()) < 2:
        pytest.skip("one JAX device: nothing to shard over")
    with pytest.raises(ValueError, match="drop_last=True"):
        JaxLoader(None, dmdask.Spec(source="unused", batch_size=52), sharding="local")
    with pytest.raises(ValueError, match="batch_size"):
        JaxLoader(None, dmdask.Spec(source="unused", batch_size=50, drop_last=True), sharding="local")


# --- on the cluster ---------------------------------------------------------------------

def _init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (FEATURES, 16)) / np.sqrt(FEATURES), "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, 2)) / 4.0, "b2": jnp.zeros(2)}


def _logits(params, x):
    return jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def _loss(params, x, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(_logits(params, x)), y[:, None], axis=1))


@jax.jit
def _step(params, velocity, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    velocity = jax.tree_util.tree_map(lambda v, g: 0.9 * v + g, velocity, grads)
    params = jax.tree_util.tree_map(lambda p, v: p - 0.05 * v, params, velocity)
    return params, velocity, loss


@pytest.mark.slow
def test_training_reduces_loss_sharded_over_local_devices(env):
    devices = len(jax.local_devices())
    batch = 13 * devices  # a multiple of the device count
    loader = JaxLoader(env["client"], _spec(env, seed=3, batch_size=batch, drop_last=True), sharding="local")
    assert len(loader) == N // batch
    params = _init(jax.random.PRNGKey(0))
    velocity = jax.tree_util.tree_map(jnp.zeros_like, params)
    epoch_loss = []
    for epoch in range(5):
        assert loader.epoch == epoch  # moved on by itself after each full pass
        losses, seen = [], []
        for b in loader:
            assert isinstance(b["x"].sharding, NamedSharding) and len(b["x"].addressable_shards) == devices
            assert b["x"].dtype == jnp.float32 and b["x"].shape == (batch, FEATURES)
            params, velocity, loss = _step(params, velocity, b["x"], b["y"])
            losses.append(float(loss))
            seen.append(b["index"])
        assert len(np.concatenate(seen)) == (N // batch) * batch
        epoch_loss.append(float(np.mean(losses)))
    assert_loss_falls(epoch_loss)
    assert_accurate(env, np.asarray(_logits(params, env["x"])).argmax(1))
    assert loader.state_dict() == {"epoch": 5, "iterator": None}


@pytest.mark.slow
def test_exactly_once_across_three_ranks(env):
    def rank_batches(rank):
        loader = JaxLoader(env["client"], _spec(env, rank=rank, world_size=3, seed=5), epoch=2)
        batches = list(loader)
        assert len(batches) == len(loader) and loader.epoch == 3
        for b in batches:
            assert isinstance(b["x"], jax.Array) and b["index"].dtype == np.int64
        return batches

    check_exactly_once(env, rank_batches)


@pytest.mark.slow
def test_elastic_resume_3_to_2_and_2_to_4_ranks(env):
    """Every rank's state_dict() as JSON (next to the params a launcher saves); a run of
    another world size loads the list and finishes the epoch: each sample exactly once."""
    check_elastic_resume(env, lambda spec: JaxLoader(env["client"], spec, epoch=1),
                         lambda state: json.loads(json.dumps(state)), np.asarray)


@pytest.mark.slow
def test_resume_continues_exactly(env):
    spec = _spec(env, seed=11, prefetch=4)
    full = JaxLoader(env["client"], spec)
    full.set_epoch(1)
    reference = list(full)

    first = JaxLoader(env["client"], spec, epoch=1)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # plain values
    assert state["epoch"] == 1 and state["iterator"]["position"] == 5

    second = JaxLoader(env["client"], spec)
    second.load_state_dict(pickle.loads(pickle.dumps(state)))
    second.set_epoch(1)  # the same epoch keeps the loaded position
    assert second.state_dict() == state
    tail = list(second)
    assert_resumed(head, tail, reference, len(second))
    assert second.state_dict() == {"epoch": 2, "iterator": None}

    # another epoch drops the loaded position; a state of another spec is refused
    check_other_epoch_and_spec(env, lambda s: JaxLoader(env["client"], s), spec, state, 4)


@pytest.mark.slow
def test_folder_source_gives_lists_of_uint8_arrays(env):
    batches = list(JaxLoader(env["client"], folder_spec(env)))
    for b in batches:
        assert isinstance(b["data"], list) and all(a.dtype == jnp.uint8 for a in b["data"])
    check_folder_batches(env, batches)


@pytest.mark.slow
def test_explicit_sharding_object(env):
    devices = len(jax.local_devices())
    sharding = local_batch_sharding("data")
    loader = JaxLoader(env["client"], _spec(env, shuffle=False, batch_size=4 * devices, drop_last=True),
                       sharding=sharding)
    b = next(iter(loader))
    assert b["x"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(b["x"]), env["x"][: 4 * devices])
    loader.close()
    assert loader.state_dict()["iterator"]["position"] == 1
