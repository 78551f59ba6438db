"""Tests for integrations.tensorflow (TFLoader) on a real two-worker dmdask cluster.

TensorFlow cannot share the main virtual environment (numpy pins), so `make test` runs
this module in .venv-tf with DMDASK_REQUIRE_FRAMEWORK=tensorflow: there a missing
TensorFlow fails the run instead of skipping it. Elsewhere the module is skipped.
"""

from __future__ import annotations

import ast
import os
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported
if "tensorflow" in os.environ.get("DMDASK_REQUIRE_FRAMEWORK", "").split(","):
    import tensorflow as tf
else:
    tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed in this environment; "
                             "`make test` runs this module in .venv-tf")
distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")

import dmdask  # noqa: E402
from integrations.tensorflow import (TFLoader, rank_of_strategy, signature_of,  # noqa: E402
                                     strategy_spec, to_tensorflow)

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
            data = rng.integers(1, 256, size=int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
            (path / cls / f"{i:03d}.bin").write_bytes(data)
            files[(cls, i)] = data
    return [files[k] for k in sorted(files)], [ord(c) - ord("a") for c, _ in sorted(files)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One real cluster (two worker processes), a client and two small datasets."""
    root = tmp_path_factory.mktemp("tfdata")
    x, y = _write_zarr(root / "train.zarr")
    blobs, labels = _write_folder(root / "files")
    cluster = dmdask.LocalCluster(n_workers=2, ram="64 MiB")
    client = distributed.Client(cluster)
    try:
        yield {"client": client, "zarr": str(root / "train.zarr"), "x": x, "y": y, "root": root,
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
    return np.concatenate([b[field].numpy() for b in batches])


def _ids(numpy_batches):
    """The sample ids of dmdask's own batches (numpy), in order."""
    return np.concatenate([b["index"] for b in numpy_batches])


def _strategy(cluster: dict, task_type: str, task_id: int):
    """A stand-in for a MultiWorkerMirroredStrategy: a real cluster resolver (a real
    multi-worker strategy blocks until every worker has joined)."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id)
    return types.SimpleNamespace(cluster_resolver=resolver)


# --- without a cluster -------------------------------------------------------------------

def test_module_imports_no_other_framework():
    tree = ast.parse((REPO_ROOT / "integrations" / "tensorflow.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert "tensorflow" in imported and not {"torch", "mxnet", "jax", "jaxlib"} & imported


def test_to_tensorflow_types_and_ragged():
    ragged = np.empty(3, dtype=object)
    ragged[:] = [np.frombuffer(b"abc", dtype=np.uint8), np.frombuffer(b"", dtype=np.uint8),
                 np.frombuffer(b"de", dtype=np.uint8)]
    images = np.empty(2, dtype=object)
    images[:] = [np.arange(6, dtype="f4").reshape(2, 3), np.arange(4, dtype="f4").reshape(1, 4)]
    ro = np.arange(3, dtype="i4")
    ro.flags.writeable = False
    batch = {"x": np.arange(6, dtype="f4").reshape(3, 2), "big": np.arange(3, dtype=">f8"), "ro": ro,
             "data": ragged, "s": np.array(["a", "bc", "d"]), "index": np.arange(3, dtype="i4")}
    out = to_tensorflow(batch)
    assert out["x"].dtype == tf.float32 and out["x"].shape == (3, 2)
    assert out["big"].dtype == tf.float64 and out["big"].numpy().tolist() == [0.0, 1.0, 2.0]
    assert out["ro"].dtype == tf.int32
    assert isinstance(out["data"], tf.RaggedTensor) and out["data"].dtype == tf.uint8
    assert out["data"].row_lengths().numpy().tolist() == [3, 0, 2]
    assert bytes(out["data"][0].numpy()) == b"abc" and bytes(out["data"][2].numpy()) == b"de"
    assert out["s"].dtype == tf.string and out["s"].numpy().tolist() == [b"a", b"bc", b"d"]
    assert out["index"].dtype == tf.int64
    img = to_tensorflow({"img": images})["img"]
    assert img.shape.rank == 3 and img.ragged_rank == 2
    np.testing.assert_array_equal(img[0].to_tensor().numpy(), images[0])
    np.testing.assert_array_equal(img[1].to_tensor().numpy(), images[1])
    as_bytes = to_tensorflow({"data": ragged}, ragged="bytes")["data"]
    assert as_bytes.dtype == tf.string and as_bytes.numpy().tolist() == [b"abc", b"", b"de"]
    with pytest.raises(ValueError, match="ragged"):
        to_tensorflow(batch, ragged="pad")

    sig = signature_of(batch)
    assert sig["x"] == tf.TensorSpec((None, 2), tf.float32)
    assert sig["index"] == tf.TensorSpec((None,), tf.int64)
    assert isinstance(sig["data"], tf.RaggedTensorSpec) and sig["data"].shape.as_list() == [None, None]


def test_rank_and_world_size_from_strategy():
    assert rank_of_strategy() == (0, 1)
    assert rank_of_strategy(tf.distribute.get_strategy()) == (0, 1)
    context = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=2, num_replicas_in_sync=3)
    assert rank_of_strategy(input_context=context) == (2, 3)
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    assert rank_of_strategy(_strategy(cluster, "chief", 0)) == (0, 3)
    assert rank_of_strategy(_strategy(cluster, "worker", 1)) == (2, 3)
    assert rank_of_strategy(_strategy({"worker": ["a:1", "b:2", "c:3"]}, "worker", 1)) == (1, 3)
    assert rank_of_strategy(_strategy({**cluster, "evaluator": ["e:1"]}, "evaluator", 0)) == (0, 1)

    spec = dmdask.Spec(source="unused", batch_size=4)
    assert strategy_spec(spec) is spec
    adopted = strategy_spec(spec, input_context=context)
    assert (adopted.rank, adopted.world_size) == (2, 3)
    assert strategy_spec(adopted, input_context=context) is adopted  # agreeing explicit values
    with pytest.raises(ValueError) as info:
        strategy_spec(spec.replace(rank=1, world_size=3), _strategy(cluster, "worker", 1))
    assert "rank=1, world_size=3" in str(info.value) and "rank=2, world_size=3" in str(info.value)
    explicit = spec.replace(rank=1, world_size=2)
    assert strategy_spec(explicit, tf.distribute.get_strategy()) is explicit  # single worker: spec decides


# --- on the cluster ---------------------------------------------------------------------

class _Epochs(tf.keras.callbacks.Callback):
    def __init__(self, loader):
        super().__init__()
        self.loader, self.states = loader, []

    def on_epoch_end(self, epoch, logs=None):
        self.states.append(self.loader.state_dict())


@pytest.mark.slow
def test_model_fit_trains_and_advances_epochs(env):
    """`model.fit(dataset, epochs=5)` under a real (single-worker) MirroredStrategy."""
    tf.keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        loader = TFLoader(env["client"], _spec(env, seed=3))  # rank, world size from the strategy in scope
        model = tf.keras.Sequential([tf.keras.Input((FEATURES,)), tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.Dense(2)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert (loader.spec.rank, loader.spec.world_size) == (0, 1) and len(loader) == -(-N // BATCH)
    ds = loader.dataset()
    assert ds.element_spec["x"] == tf.TensorSpec((None, FEATURES), tf.float32)
    assert ds.element_spec["y"] == tf.TensorSpec((None,), tf.int64)
    epochs = _Epochs(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Keras: "input ran out of data" at each epoch end
        history = model.fit(ds.map(lambda b: (b["x"], b["y"])), epochs=5, verbose=0, callbacks=[epochs])
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses
    # each fit epoch iterated the next dmdask epoch, to its end
    assert epochs.states == [{"epoch": e, "iterator": None} for e in range(1, 6)]
    accuracy = (model.predict(env["x"], verbose=0).argmax(1) == env["y"]).mean()
    assert accuracy > 0.95, accuracy

    # the next pass is epoch 5: the seeded order of that epoch, every sample once
    reference = _ids(dmdask.batches(env["client"], _spec(env, seed=3), epoch=5))
    np.testing.assert_array_equal(_cat(list(ds), "index"), reference)
    assert loader.epoch == 6


@pytest.mark.slow
def test_exactly_once_across_three_ranks(env):
    seen = []
    for rank in range(3):
        context = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=rank)
        loader = TFLoader(env["client"], _spec(env, seed=5), input_context=context, epoch=2)
        assert (loader.spec.rank, loader.spec.world_size) == (rank, 3)
        batches = list(loader.dataset())
        assert len(batches) == len(loader) and loader.epoch == 3
        for b in batches:
            assert b["index"].dtype == tf.int64 and b["x"].dtype == tf.float32
            idx = b["index"].numpy()
            np.testing.assert_array_equal(b["x"].numpy(), env["x"][idx])
            np.testing.assert_array_equal(b["y"].numpy(), env["y"][idx])
        seen.append(_cat(batches, "index"))
    allidx = np.concatenate(seen)
    assert len(allidx) == N and sorted(allidx.tolist()) == list(range(N))
    # the same as dmdask's own order: the adapter neither drops, repeats nor reorders
    for rank in range(3):
        direct = dmdask.batches(env["client"], _spec(env, seed=5, rank=rank, world_size=3), epoch=2)
        np.testing.assert_array_equal(seen[rank], _ids(direct))


@pytest.mark.slow
def test_resume_through_tf_train_checkpoint(env, tmp_path):
    spec = _spec(env, seed=11, prefetch=4)
    full = TFLoader(env["client"], spec, epoch=1)
    reference = list(full.dataset())
    assert full.state_dict() == {"epoch": 2, "iterator": None}

    first = TFLoader(env["client"], spec, epoch=1)
    head = []
    for batch in first.dataset():
        head.append(batch)
        if len(head) == 5:
            break
    state = first.state_dict()
    assert state["epoch"] == 1 and state["iterator"]["position"] == 5
    path = tf.train.Checkpoint(loader=first).write(str(tmp_path / "ckpt"))

    second = TFLoader(env["client"], spec)  # at epoch 0 until restored
    tf.train.Checkpoint(loader=second).read(path).assert_consumed()
    assert second.state_dict() == state
    second.set_epoch(1)  # the same epoch keeps the restored position
    ds = second.dataset()
    second_peek = next(iter(ds))  # an abandoned pass (as Keras takes to build a model) ...
    assert second_peek["index"].numpy().tolist() == reference[5]["index"].numpy().tolist()
    tail = list(ds)  # ... and the next pass starts at the restored position again
    assert len(head) + len(tail) == len(reference) == len(second)
    for field in ("index", "x", "y"):
        np.testing.assert_array_equal(_cat(head + tail, field), _cat(reference, field))
    assert second.state_dict() == {"epoch": 2, "iterator": None}

    # repeat=True: one stream over epochs 2 and 3, each whole and in its own order
    stream = _cat(list(second.dataset(repeat=True).take(2 * len(second))), "index")
    for k, epoch in enumerate((2, 3)):
        np.testing.assert_array_equal(stream[k * N:(k + 1) * N], _ids(dmdask.batches(env["client"], spec, epoch)))

    # another epoch drops the restored position; a state of another spec is refused
    third = TFLoader(env["client"], spec)
    third.load_state_dict(state)
    third.set_epoch(4)
    assert third.state_dict() == {"epoch": 4, "iterator": None}
    assert len(_cat(list(third.dataset()), "index")) == N
    with pytest.raises(ValueError):
        TFLoader(env["client"], _spec(env, seed=12)).load_state_dict(state)


@pytest.mark.slow
def test_folder_source_ragged_and_bytes(env):
    spec = dmdask.Spec(source=env["folder"], batch_size=4, shuffle=False, block_size=5)
    loader = TFLoader(env["client"], spec)
    assert loader.output_signature["data"] == tf.RaggedTensorSpec([None, None], tf.uint8, ragged_rank=1)
    batches = list(loader.dataset())
    assert [int(b["index"].shape[0]) for b in batches] == [4, 4, 4, 4, 4, 1]
    for b in batches:
        assert isinstance(b["data"], tf.RaggedTensor)
        for i, row in zip(b["index"].numpy().tolist(), b["data"]):
            assert bytes(row.numpy()) == env["blobs"][i]
        assert b["label"].numpy().tolist() == [env["labels"][i] for i in b["index"].numpy().tolist()]

    as_bytes = TFLoader(env["client"], spec, ragged="bytes")
    assert as_bytes.output_signature["data"] == tf.TensorSpec((None,), tf.string)
    got = {i: s for b in as_bytes.dataset() for i, s in zip(b["index"].numpy().tolist(), b["data"].numpy())}
    assert got == dict(enumerate(env["blobs"]))


# --- a real MultiWorkerMirroredStrategy: three TensorFlow worker processes ---------------------

_MWMS_WORKER = r'''
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, tensorflow as tf, distributed, dmdask
from integrations.tensorflow import TFLoader
scheduler, source, out = sys.argv[1:4]
strategy = tf.distribute.MultiWorkerMirroredStrategy()  # TF_CONFIG names this worker
client = distributed.Client(scheduler)
with strategy.scope():
    loader = TFLoader(client, dmdask.Spec(source=source, batch_size=50, seed=5, drop_last=True))
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(2)])
    opt = tf.keras.optimizers.SGD(0.1)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

@tf.function
def train_step(batch):
    def replica_step(b):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(b["y"], model(b["x"])), global_batch_size=150)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    return strategy.reduce("SUM", strategy.run(replica_step, args=(batch,)), axis=None)

ids = {}
ds = loader.distribute(strategy)
for epoch in range(2):
    seen = []
    for batch in ds:  # each pass: the loader's next epoch
        train_step(batch)
        seen.append(strategy.experimental_local_results(batch["index"])[0].numpy())
    ids[epoch] = np.concatenate(seen).tolist()
json.dump({"rank": loader.spec.rank, "world_size": loader.spec.world_size, "epoch": loader.epoch,
           "ids": ids, "weights": [w.tolist() for w in model.get_weights()]}, open(out, "w"))
client.close()
'''


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_three_workers(env, tmp_path):
    """Three TensorFlow processes under one real MultiWorkerMirroredStrategy: each takes
    its rank from the strategy, reads only its share, and they train in lock-step."""
    import json
    import subprocess
    import sys

    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(3)]}
    procs = []
    for i in range(3):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _MWMS_WORKER, env["client"].scheduler.address, env["zarr"], str(tmp_path / f"{i}.json")],
            env=dict(os.environ, TF_CONFIG=tf_config), cwd=REPO_ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(3)]
    assert [(r["rank"], r["world_size"], r["epoch"]) for r in results] == [(i, 3, 2) for i in range(3)]
    for epoch in (0, 1):
        per_rank = [np.array(r["ids"][str(epoch)]) for r in results]
        for rank, got in enumerate(per_rank):  # exactly dmdask's batches for that rank and epoch
            spec = _spec(env, seed=5, drop_last=True, rank=rank, world_size=3)
            np.testing.assert_array_equal(got, _ids(dmdask.batches(env["client"], spec, epoch=epoch)))
        together = np.concatenate(per_rank)
        assert len(np.unique(together)) == len(together) == 3 * (N // 3 // BATCH) * BATCH
    for r in results[1:]:  # the all-reduce kept the replicas in sync
        for a, b in zip(r["weights"], results[0]["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-6)
