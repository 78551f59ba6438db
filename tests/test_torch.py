"""Tests for integrations.torch (TorchLoader) on a real two-worker dmdask cluster."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
distributed = pytest.importorskip("distributed")
zarr = pytest.importorskip("zarr")

import dmdask  # noqa: E402
from integrations.torch import TorchLoader, distributed_spec, to_torch  # noqa: E402

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
    """Class-per-subfolder files of different sizes: {relative name: bytes} in sample order."""
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
    root = tmp_path_factory.mktemp("torchdata")
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
    return torch.cat([b[field] for b in batches]) if batches else torch.zeros(0)


# --- conversion (no cluster) ------------------------------------------------------------

def test_to_torch_shares_memory_and_types():
    x = np.arange(12, dtype="f4").reshape(4, 3)
    ro = np.arange(4, dtype="i4")
    ro.flags.writeable = False
    big = np.arange(4, dtype=">f8")
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.frombuffer(b"abc", dtype=np.uint8), np.frombuffer(b"de", dtype=np.uint8)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable array" warning from torch
        out = to_torch({"x": x, "ro": ro, "big": big, "data": ragged, "s": np.array(["a", "b"]),
                        "index": np.arange(4, dtype="i4")})
    assert out["x"].dtype == torch.float32 and np.shares_memory(out["x"].numpy(), x)
    assert out["ro"].tolist() == [0, 1, 2, 3] and not np.shares_memory(out["ro"].numpy(), ro)
    assert out["big"].dtype == torch.float64 and out["big"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert isinstance(out["data"], list) and [t.dtype for t in out["data"]] == [torch.uint8] * 2
    assert bytes(out["data"][0].numpy()) == b"abc" and bytes(out["data"][1].numpy()) == b"de"
    assert isinstance(out["s"], np.ndarray)  # strings pass through
    assert out["index"].dtype == torch.int64


def test_integrations_package_imports_no_framework():
    code = ("import sys, integrations; bad = {'torch', 'tensorflow', 'mxnet', 'jax'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)


def test_distributed_spec_unchanged_without_process_group():
    spec = dmdask.Spec(source="unused", batch_size=4, rank=1, world_size=3)
    if not torch.distributed.is_initialized():
        assert distributed_spec(spec) is spec


# --- on the cluster ---------------------------------------------------------------------

@pytest.mark.slow
def test_training_reduces_loss(env):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = TorchLoader(env["client"], _spec(env, seed=3))
    assert len(loader) == -(-N // BATCH)
    epoch_loss = []
    for epoch in range(5):
        loader.set_epoch(epoch)
        losses, seen = [], 0
        for batch in loader:
            assert batch["x"].dtype == torch.float32 and batch["y"].dtype == torch.int64
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            seen += len(batch["index"])
        assert seen == N
        epoch_loss.append(float(np.mean(losses)))
    assert epoch_loss[-1] < 0.5 * epoch_loss[0], epoch_loss
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(env["x"])).argmax(1).numpy() == env["y"]).mean()
    assert accuracy > 0.95, accuracy


@pytest.mark.slow
def test_exactly_once_across_three_ranks(env):
    seen = []
    for rank in range(3):
        loader = TorchLoader(env["client"], _spec(env, rank=rank, world_size=3, seed=5), epoch=2)
        batches = list(loader)
        assert len(batches) == len(loader)
        for b in batches:
            assert b["index"].dtype == torch.int64
            idx = b["index"].numpy()
            np.testing.assert_array_equal(b["x"].numpy(), env["x"][idx])
            np.testing.assert_array_equal(b["y"].numpy(), env["y"][idx])
        seen.append(_cat(batches, "index").numpy())
    allidx = np.concatenate(seen)
    assert len(allidx) == N and len(np.unique(allidx)) == N
    assert sorted(allidx.tolist()) == list(range(N))


@pytest.mark.slow
def test_resume_continues_exactly(env):
    spec = _spec(env, seed=11, prefetch=4)
    full = TorchLoader(env["client"], spec)
    full.set_epoch(1)
    reference = list(full)

    first = TorchLoader(env["client"], spec)
    first.set_epoch(1)
    head = []
    for batch in first:
        head.append(batch)
        if len(head) == 5:
            break
    state = first.state_dict()
    assert state["epoch"] == 1 and state["iterator"]["position"] == 5
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    state = torch.load(buf)["loader"]  # weights_only=True by default: plain values only

    second = TorchLoader(env["client"], spec)
    second.load_state_dict(state)
    second.set_epoch(1)  # the same epoch keeps the loaded position
    assert second.state_dict() == state
    tail = list(second)
    assert len(head) + len(tail) == len(reference) == len(second)
    for field in ("index", "x", "y"):
        assert torch.equal(_cat(head + tail, field), _cat(reference, field))
    assert second.state_dict()["iterator"]["position"] == len(reference)

    # another epoch drops the loaded position
    third = TorchLoader(env["client"], spec)
    third.load_state_dict(state)
    third.set_epoch(2)
    assert third.state_dict() == {"epoch": 2, "iterator": None}
    assert len(_cat(list(third), "index")) == N

    # a state of another spec is refused when loaded
    with pytest.raises(ValueError):
        TorchLoader(env["client"], _spec(env, seed=12)).load_state_dict(state)


@pytest.mark.slow
def test_folder_source_gives_lists_of_uint8_tensors(env):
    spec = dmdask.Spec(source=env["folder"], batch_size=4, shuffle=False, block_size=5)
    batches = list(TorchLoader(env["client"], spec))
    assert [len(b["index"]) for b in batches] == [4, 4, 4, 4, 4, 1]
    for b in batches:
        assert isinstance(b["data"], list) and all(t.dtype == torch.uint8 for t in b["data"])
        for i, t in zip(b["index"].tolist(), b["data"]):
            assert bytes(t.numpy()) == env["blobs"][i]
        assert b["label"].tolist() == [env["labels"][i] for i in b["index"].tolist()]


@pytest.mark.slow
def test_pin_memory_and_device(env):
    loader = TorchLoader(env["client"], _spec(env, shuffle=False), pin_memory=True, device="cpu")
    assert loader.pin_memory == torch.cuda.is_available()  # a no-op without CUDA
    batch = next(iter(loader))
    assert batch["x"].device.type == "cpu" and batch["x"].shape == (BATCH, FEATURES)
    if torch.cuda.is_available():
        assert batch["x"].is_pinned()
    loader.close()
    assert loader.state_dict()["iterator"]["position"] == 1


@pytest.mark.slow
def test_refuses_dataloader_worker(env, monkeypatch):
    loader = TorchLoader(env["client"], _spec(env))
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        iter(loader)


# --- torch.distributed ----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_group():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                         rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_rank_and_world_size_from_torch_distributed(env, gloo_group, monkeypatch):
    loader = TorchLoader(env["client"], _spec(env))
    assert (loader.spec.rank, loader.spec.world_size) == (0, 1)
    assert len(_cat(list(loader), "index")) == N

    with pytest.raises(ValueError) as info:
        TorchLoader(env["client"], _spec(env, rank=1, world_size=3))
    message = str(info.value)
    assert "rank=1, world_size=3" in message and "rank=0, world_size=1" in message

    # a larger group: defaults are replaced, agreeing explicit values are kept
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 2)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 3)
    adopted = TorchLoader(env["client"], _spec(env, seed=9))
    assert (adopted.spec.rank, adopted.spec.world_size) == (2, 3)
    explicit = TorchLoader(env["client"], _spec(env, seed=9, rank=2, world_size=3))
    assert explicit.spec == adopted.spec
    assert torch.equal(_cat(list(adopted), "index"), _cat(list(explicit), "index"))
    with pytest.raises(ValueError, match="rank=1, world_size=3"):
        TorchLoader(env["client"], _spec(env, rank=1, world_size=3))
