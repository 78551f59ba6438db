"""Tests for dmdask.integrations.tensorflow (TFLoader) on a real two-worker dmdask cluster.

TensorFlow cannot share the main virtual environment (numpy pins), so `make test` runs
this module in .venv-tf with DMDASK_REQUIRE_FRAMEWORK=tensorflow: there a missing
TensorFlow fails the run instead of skipping it. Elsewhere the module is skipped.
"""

from __future__ import annotations

import os
import types
import warnings

import distributed
import numpy as np
import pytest
import zarr

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported
if "tensorflow" in os.environ.get("DMDASK_REQUIRE_FRAMEWORK", "").split(","):
    import tensorflow as tf
else:
    tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed in this environment; "
                             "`make test` runs this module in .venv-tf")

import dmdask  # noqa: E402
from framework_cases import (BATCH, FEATURES, N, REPO_ROOT, assert_accurate, assert_loss_falls,  # noqa: E402
                             assert_resumed, cat, check_exactly_once, check_folder_batches,
                             check_other_epoch_and_spec, check_worker_results, dmdask_ids, env_fixture,
                             folder_spec, free_port, imported_modules, take, wait_all, zarr_spec)
from dmdask.integrations.tensorflow import (TFLoader, rank_of_strategy, signature_of,  # noqa: E402
                                     strategy_spec, to_tensorflow)

env = env_fixture("tfdata", lowest_byte=1)  # no NUL bytes in the files: see write_folder
_spec = zarr_spec


def _np(tensor):
    return tensor.numpy()


def _strategy(cluster: dict, task_type: str, task_id: int):
    """A stand-in for a MultiWorkerMirroredStrategy: a real cluster resolver (a real
    multi-worker strategy blocks until every worker has joined)."""
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id)
    return types.SimpleNamespace(cluster_resolver=resolver)


# --- without a cluster -------------------------------------------------------------------

def test_module_imports_no_other_framework():
    imported = imported_modules("dmdask/integrations/tensorflow.py")
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
    assert_loss_falls(history.history["loss"])
    # each fit epoch iterated the next dmdask epoch, to its end
    assert epochs.states == [{"epoch": e, "iterator": None} for e in range(1, 6)]
    assert_accurate(env, model.predict(env["x"], verbose=0).argmax(1))

    # the next pass is epoch 5: the seeded order of that epoch, every sample once
    np.testing.assert_array_equal(cat(list(ds), "index", _np), dmdask_ids(env, _spec(env, seed=3), 5))
    assert loader.epoch == 6


@pytest.mark.slow
def test_exactly_once_across_three_ranks(env):
    def rank_batches(rank):
        context = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=rank)
        loader = TFLoader(env["client"], _spec(env, seed=5), input_context=context, epoch=2)
        assert (loader.spec.rank, loader.spec.world_size) == (rank, 3)
        batches = list(loader.dataset())
        assert len(batches) == len(loader) and loader.epoch == 3
        for b in batches:
            assert b["index"].dtype == tf.int64 and b["x"].dtype == tf.float32
        return batches

    # every sample once, in dmdask's own order: the adapter neither drops, repeats nor reorders
    check_exactly_once(env, rank_batches, _np)


@pytest.mark.slow
def test_resume_through_tf_train_checkpoint(env, tmp_path):
    spec = _spec(env, seed=11, prefetch=4)
    full = TFLoader(env["client"], spec, epoch=1)
    reference = list(full.dataset())
    assert full.state_dict() == {"epoch": 2, "iterator": None}

    first = TFLoader(env["client"], spec, epoch=1)
    head = take(first.dataset(), 5)
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
    assert_resumed(head, tail, reference, len(second), _np)
    assert second.state_dict() == {"epoch": 2, "iterator": None}

    # repeat=True: one stream over epochs 2 and 3, each whole and in its own order
    stream = cat(list(second.dataset(repeat=True).take(2 * len(second))), "index", _np)
    for k, epoch in enumerate((2, 3)):
        np.testing.assert_array_equal(stream[k * N:(k + 1) * N], dmdask_ids(env, spec, epoch))

    # another epoch drops the restored position; a state of another spec is refused
    check_other_epoch_and_spec(env, lambda s: TFLoader(env["client"], s), spec, state, 4,
                               batches_of=lambda loader: list(loader.dataset()), to_numpy=_np)


@pytest.mark.slow
def test_folder_source_ragged_and_bytes(env):
    spec = folder_spec(env)
    loader = TFLoader(env["client"], spec)
    assert loader.output_signature["data"] == tf.RaggedTensorSpec([None, None], tf.uint8, ragged_rank=1)
    batches = list(loader.dataset())
    assert all(isinstance(b["data"], tf.RaggedTensor) for b in batches)
    check_folder_batches(env, batches, _np)

    as_bytes = TFLoader(env["client"], spec, ragged="bytes")
    assert as_bytes.output_signature["data"] == tf.TensorSpec((None,), tf.string)
    got = {i: s for b in as_bytes.dataset() for i, s in zip(b["index"].numpy().tolist(), b["data"].numpy())}
    assert got == dict(enumerate(env["blobs"]))


# --- a real MultiWorkerMirroredStrategy: three TensorFlow worker processes ---------------------

_MWMS_WORKER = r'''
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np, tensorflow as tf, distributed, dmdask
from dmdask.integrations.tensorflow import TFLoader
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


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_three_workers(env, tmp_path):
    """Three TensorFlow processes under one real MultiWorkerMirroredStrategy: each takes
    its rank from the strategy, reads only its share, and they train in lock-step."""
    import json
    import subprocess
    import sys

    cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(3)]}
    procs = []
    for i in range(3):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _MWMS_WORKER, env["client"].scheduler.address, env["zarr"], str(tmp_path / f"{i}.json")],
            env=dict(os.environ, TF_CONFIG=tf_config), cwd=REPO_ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    wait_all(procs, timeout=240)
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(3)]
    check_worker_results(env, results)  # the all-reduce kept the replicas in sync
