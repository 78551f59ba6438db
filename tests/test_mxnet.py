"""Tests for integrations.mxnet (MXNetLoader, DmdaskDataIter) on a real two-worker dmdask cluster.

MXNet 1.9.1 needs numpy < 2, so `make test` runs this module in .venv-mx with
DMDASK_REQUIRE_FRAMEWORK=mxnet: there a missing MXNet fails the run instead of
skipping it. Elsewhere the module is skipped.
"""

from __future__ import annotations

import ast
import os
import pickle
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

if "mxnet" in os.environ.get("DMDASK_REQUIRE_FRAMEWORK", "").split(","):
    import integrations.mxnet  # noqa: F401  (the numpy shim, then mxnet itself)
else:
    # through the adapter: it sets the numpy alias MXNet 1.9.1 needs before importing it
    pytest.importorskip("integrations.mxnet", reason="MXNet is not installed in this environment; "
                        "`make test` runs this module in .venv-mx")
distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import dmdask  # noqa: E402
from integrations.mxnet import DmdaskDataIter, MXNetLoader, kvstore_spec, to_mxnet  # noqa: E402

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
    root = tmp_path_factory.mktemp("mxdata")
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
    return np.concatenate([b[field].asnumpy() for b in batches])


def _ids(numpy_batches):
    """The sample ids of dmdask's own batches (numpy), in order."""
    return np.concatenate([b["index"] for b in numpy_batches])


# --- without a cluster -------------------------------------------------------------------

def test_module_imports_no_other_framework():
    tree = ast.parse((REPO_ROOT / "integrations" / "mxnet.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
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
    assert epoch_loss[-1] < 0.5 * epoch_loss[0], epoch_loss
    accuracy = (net(mx.nd.array(env["x"])).asnumpy().argmax(1) == env["y"]).mean()
    assert accuracy > 0.95, accuracy


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
    losses = [per_epoch[e] for e in range(5)]
    assert losses[-1] < 0.5 * losses[0], losses
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
    np.testing.assert_array_equal(ids, _ids(dmdask.batches(env["client"], _spec(env, seed=4), epoch=7)))
    for b in batches[:3]:
        np.testing.assert_array_equal(b.data[0].asnumpy(), env["x"][b.index])
        np.testing.assert_array_equal(b.label[0].asnumpy(), env["y"][b.index])
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
    seen = []
    for rank in range(3):
        kv = types.SimpleNamespace(rank=rank, num_workers=3)
        loader = MXNetLoader(env["client"], _spec(env, seed=5), kvstore=kv, epoch=2)
        assert (loader.spec.rank, loader.spec.world_size) == (rank, 3)
        batches = list(loader)
        assert len(batches) == len(loader) and loader.epoch == 3
        for b in batches:
            assert b["index"].dtype == np.int64
            idx = b["index"].asnumpy()
            np.testing.assert_array_equal(b["x"].asnumpy(), env["x"][idx])
            np.testing.assert_array_equal(b["y"].asnumpy(), env["y"][idx])
        seen.append(_cat(batches, "index"))
        direct = dmdask.batches(env["client"], _spec(env, seed=5, rank=rank, world_size=3), epoch=2)
        np.testing.assert_array_equal(seen[-1], _ids(direct))
    allidx = np.concatenate(seen)
    assert len(allidx) == N and sorted(allidx.tolist()) == list(range(N))


@pytest.mark.slow
def test_resume_continues_exactly(env):
    spec = _spec(env, seed=11, prefetch=4)
    full = MXNetLoader(env["client"], spec, epoch=1)
    reference = list(full)
    assert full.state_dict() == {"epoch": 2, "iterator": None}

    first = MXNetLoader(env["client"], spec, epoch=1)
    head = []
    for batch in first:
        head.append(batch)
        if len(head) == 5:
            break
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert state["epoch"] == 1 and state["iterator"]["position"] == 5

    second = MXNetLoader(env["client"], spec)
    second.load_state_dict(state)
    second.set_epoch(1)  # the same epoch keeps the loaded position
    assert second.state_dict() == state
    tail = list(second)
    assert len(head) + len(tail) == len(reference) == len(second)
    for field in ("index", "x", "y"):
        np.testing.assert_array_equal(_cat(head + tail, field), _cat(reference, field))
    assert second.state_dict() == {"epoch": 2, "iterator": None}

    # the DataIter resumes the same way (Module.fit(..., begin_epoch=state["epoch"]))
    it = DmdaskDataIter(env["client"], spec, data_names=("x",), label_names=("y",))
    it.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate([b.index for b in it]), _cat(tail, "index"))
    assert it.epoch == 2

    # another epoch drops the loaded position; a state of another spec is refused
    third = MXNetLoader(env["client"], spec)
    third.load_state_dict(state)
    third.set_epoch(4)
    assert third.state_dict() == {"epoch": 4, "iterator": None}
    assert len(_cat(list(third), "index")) == N
    with pytest.raises(ValueError):
        MXNetLoader(env["client"], _spec(env, seed=12)).load_state_dict(state)


@pytest.mark.slow
def test_folder_source_gives_lists_of_uint8_ndarrays(env):
    spec = dmdask.Spec(source=env["folder"], batch_size=4, shuffle=False, block_size=5)
    batches = list(MXNetLoader(env["client"], spec))
    assert [b["index"].shape[0] for b in batches] == [4, 4, 4, 4, 4, 1]
    for b in batches:
        assert isinstance(b["data"], list) and all(a.dtype == np.uint8 for a in b["data"])
        for i, a in zip(b["index"].asnumpy().tolist(), b["data"]):
            assert bytes(a.asnumpy()) == env["blobs"][i]
        assert b["label"].asnumpy().tolist() == [env["labels"][i] for i in b["index"].asnumpy().tolist()]
    with pytest.raises(TypeError, match="variable-size"):
        DmdaskDataIter(env["client"], spec, data_names=("data",), label_names=("label",))


# --- a real "dist_sync" kvstore: three MXNet worker processes, a server and a scheduler ----------

_DIST_WORKER = r'''
import json, sys
import integrations.mxnet  # the numpy shim, then mxnet
import mxnet as mx, numpy as np, distributed, dmdask
from mxnet import autograd, gluon
from integrations.mxnet import MXNetLoader
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_dist_sync_kvstore_three_workers(env, tmp_path):
    """Three MXNet processes on one "dist_sync" kvstore: each takes its rank from the
    store, reads only its share, and the parameter server keeps them in sync."""
    import json
    import subprocess
    import sys

    base = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(_free_port()),
                DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="3")
    shim = "import integrations.mxnet"  # a scheduler or server process blocks in `import mxnet` until done
    run = dict(cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = [subprocess.Popen([sys.executable, "-c", shim], env=dict(base, DMLC_ROLE=role), **run)
             for role in ("scheduler", "server")]
    procs += [subprocess.Popen([sys.executable, "-c", _DIST_WORKER, env["client"].scheduler.address, env["zarr"],
                                str(tmp_path / f"{i}.json")], env=dict(base, DMLC_ROLE="worker"), **run)
              for i in range(3)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs[2:] + procs[:2]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, output in zip(procs[2:] + procs[:2], outputs):
        assert p.returncode == 0, output[-3000:]
    results = sorted((json.loads((tmp_path / f"{i}.json").read_text()) for i in range(3)), key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"], r["epoch"]) for r in results] == [(i, 3, 2) for i in range(3)]
    for epoch in (0, 1):
        per_rank = [np.array(r["ids"][str(epoch)]) for r in results]
        for rank, got in enumerate(per_rank):  # exactly dmdask's batches for that rank and epoch
            spec = _spec(env, seed=5, drop_last=True, rank=rank, world_size=3)
            np.testing.assert_array_equal(got, _ids(dmdask.batches(env["client"], spec, epoch=epoch)))
        together = np.concatenate(per_rank)
        assert len(np.unique(together)) == len(together) == 3 * (N // 3 // BATCH) * BATCH
    for r in results[1:]:  # the parameter server kept the workers in sync
        for a, b in zip(r["weights"], results[0]["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-6)
