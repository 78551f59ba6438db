"""Tests for integrations.jax (JaxLoader) on a real two-worker dmdask cluster.

Runs in the main environment (CPU jax/jaxlib). JAX is given four CPU devices here, so
that sharding a batch over local devices is real.
"""

from __future__ import annotations

import ast
import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed in this environment (`make test` installs it in .venv)")
distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")

try:  # before JAX starts its backend: four CPU devices for the sharding tests
    jax.config.update("jax_num_cpu_devices", 4)
except (AttributeError, RuntimeError):  # an older JAX, or a backend some other module started
    pass

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import dmdask  # noqa: E402
from integrations.jax import JaxLoader, local_batch_sharding, process_spec, to_jax  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
N = 1003        # not a multiple of the chunk (64) nor of the batch size (50)
FEATURES = 8
BATCH = 50


def _write_zarr(path: Path):
    rng = np.random.default_rng(42)
    x = rng.normal(size=(N, FEATURES)).astype("f4")
    w = rng.normal(size=FEATURES)
    y = (x @ w > 0).astype("i8")  # linearly separable, two classes
    g = zarr.open_group(str(path), mode="w")
    g.create_array("x", shape=x.shape, chunks=(64, FEATURES), dtype="f4")
    g.create_array("y", shape=y.shape, chunks=(64,), dtype="i8")
    g["x"][:] = x
    g["y"][:] = y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "consolidated metadata is not part of the v3 spec"
        zarr.consolidate_metadata(str(path))
    return x, y


def _write_folder(path: Path):
    """Class-per-subfolder files of different sizes: bytes and labels in sample order."""
    rng = np.random.default_rng(7)
    files = {}
    for cls in ("a", "b", "c"):
        (path / cls).mkdir(parents=True)
        for i in range(7):
            data = rng.integers(0, 256, size=int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
            (path / cls / f"{i:03d}.bin").write_bytes(data)
            files[(cls, i)] = data
    return [files[k] for k in sorted(files)], [ord(c) - ord("a") for c, _ in sorted(files)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One real cluster (two worker processes), a client and two small datasets."""
    root = tmp_path_factory.mktemp("jaxdata")
    x, y = _write_zarr(root / "train.zarr")
    blobs, labels = _write_folder(root / "files")
    cluster = dmdask.LocalCluster(n_workers=2, ram="64 MiB")
    client = distributed.Client(cluster)
    try:
        yield {"client": client, "zarr": str(root / "train.zarr"), "x": x, "y": y,
               "folder": str(root / "files"), "blobs": blobs, "labels": labels}
    finally:
        for source, block_size in ((str(root / "train.zarr"), None), (str(root / "files"), 5)):
            dmdask.release(client, dmdask.Spec(source=source, batch_size=1, block_size=block_size))
        client.close()
        cluster.close()


def _spec(env, **kw):
    kw.setdefault("batch_size", BATCH)
    return dmdask.Spec(source=env["zarr"], **kw)


def _cat(batches, field):
    return np.concatenate([np.asarray(b[field]) for b in batches])


def _ids(numpy_batches):
    """The sample ids of dmdask's own batches (numpy), in order."""
    return np.concatenate([b["index"] for b in numpy_batches])


# --- without a cluster -------------------------------------------------------------------

def test_module_imports_no_other_framework():
    tree = ast.parse((REPO_ROOT / "integrations" / "jax.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
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
    assert epoch_loss[-1] < 0.5 * epoch_loss[0], epoch_loss
    accuracy = (np.asarray(_logits(params, env["x"])).argmax(1) == env["y"]).mean()
    assert accuracy > 0.95, accuracy
    assert loader.state_dict() == {"epoch": 5, "iterator": None}


@pytest.mark.slow
def test_exactly_once_across_three_ranks(env):
    seen = []
    for rank in range(3):
        loader = JaxLoader(env["client"], _spec(env, rank=rank, world_size=3, seed=5), epoch=2)
        batches = list(loader)
        assert len(batches) == len(loader) and loader.epoch == 3
        for b in batches:
            assert isinstance(b["x"], jax.Array) and b["index"].dtype == np.int64
            np.testing.assert_array_equal(np.asarray(b["x"]), env["x"][b["index"]])
            np.testing.assert_array_equal(np.asarray(b["y"]), env["y"][b["index"]])
        seen.append(_cat(batches, "index"))
        direct = dmdask.batches(env["client"], _spec(env, rank=rank, world_size=3, seed=5), epoch=2)
        np.testing.assert_array_equal(seen[-1], _ids(direct))
    allidx = np.concatenate(seen)
    assert len(allidx) == N and sorted(allidx.tolist()) == list(range(N))


@pytest.mark.slow
def test_resume_continues_exactly(env):
    spec = _spec(env, seed=11, prefetch=4)
    full = JaxLoader(env["client"], spec)
    full.set_epoch(1)
    reference = list(full)

    first = JaxLoader(env["client"], spec, epoch=1)
    head = []
    for batch in first:
        head.append(batch)
        if len(head) == 5:
            break
    state = json.loads(json.dumps(first.state_dict()))  # plain values
    assert state["epoch"] == 1 and state["iterator"]["position"] == 5

    second = JaxLoader(env["client"], spec)
    second.load_state_dict(pickle.loads(pickle.dumps(state)))
    second.set_epoch(1)  # the same epoch keeps the loaded position
    assert second.state_dict() == state
    tail = list(second)
    assert len(head) + len(tail) == len(reference) == len(second)
    for field in ("index", "x", "y"):
        np.testing.assert_array_equal(_cat(head + tail, field), _cat(reference, field))
    assert second.state_dict() == {"epoch": 2, "iterator": None}

    third = JaxLoader(env["client"], spec)
    third.load_state_dict(state)
    third.set_epoch(4)  # another epoch drops the loaded position
    assert third.state_dict() == {"epoch": 4, "iterator": None}
    assert len(_cat(list(third), "index")) == N
    with pytest.raises(ValueError):
        JaxLoader(env["client"], _spec(env, seed=12)).load_state_dict(state)


@pytest.mark.slow
def test_folder_source_gives_lists_of_uint8_arrays(env):
    spec = dmdask.Spec(source=env["folder"], batch_size=4, shuffle=False, block_size=5)
    batches = list(JaxLoader(env["client"], spec))
    assert [len(b["index"]) for b in batches] == [4, 4, 4, 4, 4, 1]
    for b in batches:
        assert isinstance(b["data"], list) and all(a.dtype == jnp.uint8 for a in b["data"])
        for i, a in zip(b["index"].tolist(), b["data"]):
            assert bytes(np.asarray(a)) == env["blobs"][i]
        assert np.asarray(b["label"]).tolist() == [env["labels"][i] for i in b["index"].tolist()]


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
