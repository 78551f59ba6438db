"""Tests for dmdask.integrations.mxnet (MXNetLoader, DmdaskDataIter) on a real two-worker dmdask cluster.

MXNet 1.9.1 needs numpy < 2, so `make test` runs this module in .venv-mx with
DMDASK_REQUIRE_FRAMEWORK=mxnet: there a missing MXNet fails the run instead of
skipping it. Elsewhere the module is skipped.
"""

from __future__ import annotations

import os
import pickle
import types

import distributed
import numpy as np
import pytest
import zarr

if "mxnet" in os.environ.get("DMDASK_REQUIRE_FRAMEWORK", "").split(","):
    import dmdask.integrations.mxnet  # noqa: F401  (the numpy shim, then mxnet itself)
else:
    # through the adapter: it sets the numpy alias MXNet 1.9.1 needs before importing it
    pytest.importorskip("dmdask.integrations.mxnet", reason="MXNet is not installed in this environment; "
                        "`make test` runs this module in .venv-mx")

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import dmdask  # noqa: E402
from framework_cases import (BATCH, FEATURES, N, REPO_ROOT, assert_accurate, assert_content,  # noqa: E402
                             assert_loss_falls, assert_resumed, cat, check_exactly_once,
                             check_folder_batches, check_other_epoch_and_spec, check_worker_results,
                             dmdask_ids, env_fixture, folder_spec, free_port, imported_modules, take,
                             wait_all, zarr_spec)
from dmdask.integrations.mxnet import DmdaskDataIter, MXNetLoader, kvstore_spec, to_mxnet  # noqa: E402

env = env_fixture("mxdata")
_spec = zarr_spec


def _np(array):
    return array.asnumpy()


# --- without a cluster -------------------------------------------------------------------

def test_module_imports_no_other_framework():
    imported = imported_modules("dmdask/integrations/mxnet.py")
    assert "mxnet" in imported and not {"torch", "tensorflow", "jax", "jaxlib"} & imported


def test_numpy_shim_and_core_on_numpy_1():
    assert np.bool is bool or np.__version__.startswith("2")  # the alias MXNet 1.9.1 needs
    assert mx.nd.array([True, False], dtype=np.bool_).asnumpy().tolist() == [True, False]


def test_to_mxnet_types():
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.frombuffer(b"abc", dtype=np.uint8), np.frombuffer(b"de", dtype=np.uint8)]
    out = to_mxnet({"x": np.arange(6, dtype="f4").reshape(3, 2), "big": np.arange(3, dtype=">f8"),
                    "u16": np.arange(3, dtype="u2"), "c": np.ones(3, dtype="c8"), "data": ragged,
                    "s": np.array(["a", "b", "c"]), "index": np.arange(3, dtype="i4")})
    assert isinstance(out["x"], mx.nd.NDArray) and out["x"].dtype == np.float32 and out["x"].shape == (3, 2)
    assert out["big"].dtype == np.float64 and out["big"].asnumpy().tolist() == [0.0, 1.0, 2.0]
    assert out["u16"].dtype == np.int32 and out["u16"].asnumpy().tolist() == [0, 1, 2]
    assert isinstance(out["c"], np.ndarray)  # no complex NDArray: left as numpy
    assert [bytes(a.asnumpy()) for a in out["data"]] == [b"abc", b"de"]
    assert isinstance(out["s"], np.ndarray)
    assert out["index"].dtype == np.int64


def test_rank_and_world_size_from_kvstore():
    spec = dmdask.Spec(source="unused", batch_size=4)
    assert kvstore_spec(spec) is spec
    assert kvstore_spec(spec, mx.kv.create("local")) is spec  # a local store: one worker
    dist = types.SimpleNamespace(rank=2, num_workers=3)  # as a "dist_sync" store reports them
    adopted = kvstore_spec(spec, dist)
    assert (adopted.rank, adopted.world_size) == (2, 3)
    assert kvstore_spec(adopted, dist) is adopted
    with pytest.raises(ValueError, match="rank=1, world_size=3"):
        kvstore_spec(spec.replace(rank=1, world_size=3), dist)


# --- on the cluster ---------------------------------------------------------------------

@pytest.mark.slow
def test_gluon_training_reduces_loss(env):
    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(2))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    loader = MXNetLoader(env["client"], _spec(env, seed=3))
    assert len(loader) == -(-N // BATCH)
    epoch_loss = []
    for epoch in range(5):
        assert loader.epoch == epoch  # the loader moved on by itself
        loader.set_epoch(epoch)  # ... and agrees with the usual explicit call
        losses, seen = [], 0
        for batch in loader:
            assert batch["x"].dtype == np.float32 and batch["y"].dtype == np.int64
            with autograd.record():
                loss = loss_fn(net(batch["x"]), batch["y"])
            loss.backward()
            trainer.step(batch["x"].shape[0])
            losses.append(float(loss.mean().asscalar()))
            seen += batch["index"].shape[0]
        assert seen == N
        epoch_loss.append(float(np.mean(losses)))
    assert_loss_falls(epoch_loss)
    assert_accurate(env, net(mx.nd.array(env["x"])).asnumpy().argmax(1))


@pytest.mark.slow
def test_module_fit_with_data_iter(env):
    train = DmdaskDataIter(env["client"], _spec(env, seed=4), data_names=("x",), label_names=("y",))
    assert train.provide_data == [mx.io.DataDesc("x", (BATCH, FEATURES), np.float32)]
    assert train.provide_label[0].name == "y" and train.provide_label[0].shape == (BATCH,)
    x, y = mx.sym.var("x"), mx.sym.var("y")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(x, num_hidden=16), act_type="relu")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(hidden, num_hidden=2), label=mx.sym.cast(y, "float32"),
                               name="softmax")
    mod = mx.mod.Module(out, data_names=("x",), label_names=("y",), context=mx.cpu())
    per_epoch = {}

    def on_batch(param):
        per_epoch[param.epoch] = dict(param.eval_metric.get_name_value())["cross-entropy"]

    ends = []
    mx.random.seed(0)
    mod.fit(train, num_epoch=5, eval_metric="ce", optimizer="sgd", initializer=mx.init.Xavier(),
            optimizer_params={"learning_rate": 0.05, "momentum": 0.9}, batch_end_callback=on_batch,
            epoch_end_callback=lambda epoch, *a: ends.append(train.state_dict()))
    assert_loss_falls([per_epoch[e] for e in range(5)])
    # each fit epoch iterated the next dmdask epoch to its end (the short last batch included)
    assert ends == [{"epoch": e, "iterator": None} for e in range(1, 6)]
    scores = dict(mod.score(mx.io.NDArrayIter(env["x"], env["y"].astype("f4"), batch_size=BATCH,
                                              data_name="x", label_name="y"), "acc"))
    assert scores["accuracy"] > 0.95, scores

    # DataBatch content, the short last batch and reset() part-way
    train.set_epoch(7)
    batches = list(train)
    assert [b.data[0].shape[0] for b in batches] == [BATCH] * (N // BATCH) + [N % BATCH]
    assert batches[-1].provide_data[0].shape == (N % BATCH, FEATURES) and all(b.pad == 0 for b in batches)
    ids = np.concatenate([b.index for b in batches])
    np.testing.assert_array_equal(ids, dmdask_ids(env, _spec(env, seed=4), 7))
    assert_content(env, [{"index": b.index, "x": b.data[0].asnumpy(), "y": b.label[0].asnumpy()}
                         for b in batches[:3]])
    with pytest.raises(StopIteration):
        train.next()
    assert train.epoch == 8
    train.reset()  # after a finished epoch: the next one
    first = train.next().index
    train.next()
    train.reset()  # part-way: the same epoch again from its start
    np.testing.assert_array_equal(train.next().index, first)
    assert train.epoch == 8
    train.close()


@pytest.mark.slow
def test_exactly_once_across_three_ranks(env):
    def rank_batches(rank):
        kv = types.SimpleNamespace(rank=rank, num_workers=3)
        loader = MXNetLoader(env["client"], _spec(env, seed=5), kvstore=kv, epoch=2)
        assert (loader.spec.rank, loader.spec.world_size) == (rank, 3)
        batches = list(loader)
        assert len(batches) == len(loader) and loader.epoch == 3
        assert all(b["index"].dtype == np.int64 for b in batches)
        return batches

    check_exactly_once(env, rank_batches, _np)


@pytest.mark.slow
def test_resume_continues_exactly(env):
    spec = _spec(env, seed=11, prefetch=4)
    full = MXNetLoader(env["client"], spec, epoch=1)
    reference = list(full)
    assert full.state_dict() == {"epoch": 2, "iterator": None}

    first = MXNetLoader(env["client"], spec, epoch=1)
    head = take(first, 5)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert state["epoch"] == 1 and state["iterator"]["position"] == 5

    second = MXNetLoader(env["client"], spec)
    second.load_state_dict(state)
    second.set_epoch(1)  # the same epoch keeps the loaded position
    assert second.state_dict() == state
    tail = list(second)
    assert_resumed(head, tail, reference, len(second), _np)
    assert second.state_dict() == {"epoch": 2, "iterator": None}

    # the DataIter resumes the same way (Module.fit(..., begin_epoch=state["epoch"]))
    it = DmdaskDataIter(env["client"], spec, data_names=("x",), label_names=("y",))
    it.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate([b.index for b in it]), cat(tail, "index", _np))
    assert it.epoch == 2

    # another epoch drops the loaded position; a state of another spec is refused
    check_other_epoch_and_spec(env, lambda s: MXNetLoader(env["client"], s), spec, state, 4, to_numpy=_np)


@pytest.mark.slow
def test_folder_source_gives_lists_of_uint8_ndarrays(env):
    spec = folder_spec(env)
    batches = list(MXNetLoader(env["client"], spec))
    for b in batches:
        assert isinstance(b["data"], list) and all(a.dtype == np.uint8 for a in b["data"])
    check_folder_batches(env, batches, _np)
    with pytest.raises(TypeError, match="variable-size"):
        DmdaskDataIter(env["client"], spec, data_names=("data",), label_names=("label",))


# --- a real "dist_sync" kvstore: three MXNet worker processes, a server and a scheduler ----------

_DIST_WORKER = r'''
import json, sys
import dmdask.integrations.mxnet  # the numpy shim, then mxnet
import mxnet as mx, numpy as np, distributed, dmdask
from mxnet import autograd, gluon
from dmdask.integrations.mxnet import MXNetLoader
scheduler, source, out = sys.argv[1:4]
kv = mx.kv.create("dist_sync")
client = distributed.Client(scheduler)
loader = MXNetLoader(client, dmdask.Spec(source=source, batch_size=50, seed=5, drop_last=True), kvstore=kv)
mx.random.seed(0)
net = gluon.nn.Dense(2, in_units=8)
net.initialize(mx.init.Xavier())
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
ids = {}
for epoch in range(2):
    seen = []
    for batch in loader:  # each pass: the loader's next epoch
        with autograd.record():
            loss = loss_fn(net(batch["x"]), batch["y"])
        loss.backward()
        trainer.step(batch["x"].shape[0] * kv.num_workers)
        seen.append(batch["index"].asnumpy())
    ids[epoch] = np.concatenate(seen).tolist()
json.dump({"rank": loader.spec.rank, "world_size": loader.spec.world_size, "epoch": loader.epoch, "ids": ids,
           "weights": [p.data().asnumpy().tolist() for p in net.collect_params().values()]}, open(out, "w"))
client.close()
'''


@pytest.mark.slow
def test_dist_sync_kvstore_three_workers(env, tmp_path):
    """Three MXNet processes on one "dist_sync" kvstore: each takes its rank from the
    store, reads only its share, and the parameter server keeps them in sync."""
    import json
    import subprocess
    import sys

    base = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()),
                DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="3")
    shim = "import dmdask.integrations.mxnet"  # a scheduler or server process blocks in `import mxnet` until done
    run = dict(cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = [subprocess.Popen([sys.executable, "-c", shim], env=dict(base, DMLC_ROLE=role), **run)
             for role in ("scheduler", "server")]
    procs += [subprocess.Popen([sys.executable, "-c", _DIST_WORKER, env["client"].scheduler.address, env["zarr"],
                                str(tmp_path / f"{i}.json")], env=dict(base, DMLC_ROLE="worker"), **run)
              for i in range(3)]
    wait_all(procs[2:] + procs[:2], timeout=120)
    results = sorted((json.loads((tmp_path / f"{i}.json").read_text()) for i in range(3)), key=lambda r: r["rank"])
    check_worker_results(env, results)  # the parameter server kept the workers in sync
