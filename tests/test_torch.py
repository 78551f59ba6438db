"""Tests for dmdask.integrations.torch (TorchLoader) on a real two-worker dmdask cluster."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings

import distributed
import numpy as np
import pytest
import zarr

torch = pytest.importorskip("torch")

from framework_cases import (  # noqa: E402
    BATCH,
    FEATURES,
    REPO_ROOT,
    N,
    assert_accurate,
    assert_loss_falls,
    assert_resumed,
    cat,
    check_elastic_resume,
    check_exactly_once,
    check_folder_batches,
    check_other_epoch_and_spec,
    env_fixture,
    folder_spec,
    free_port,
    imported_modules,
    take,
    zarr_spec,
)

import dmdask  # noqa: E402
from dmdask.integrations.torch import TorchLoader, distributed_spec, to_torch  # noqa: E402

env = env_fixture("torchdata")
_spec = zarr_spec


def _np(tensor):
    return tensor.numpy()


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
    code = ("import sys, dmdask.integrations; bad = {'torch', 'tensorflow', 'mxnet', 'jax'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)


def test_imports_only_torch():
    frameworks = {"torch", "tensorflow", "mxnet", "jax", "jaxlib"}
    assert frameworks & imported_modules("dmdask/integrations/torch.py") == {"torch"}
    for shared in ("_passes.py", "_rank.py", "_fields.py"):  # what the adapters share imports none
        assert not frameworks & imported_modules(f"dmdask/integrations/{shared}")


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
    assert_loss_falls(epoch_loss)
    with torch.no_grad():
        assert_accurate(env, model(torch.from_numpy(env["x"])).argmax(1).numpy())


@pytest.mark.slow
def test_exactly_once_across_three_ranks(env):
    def rank_batches(rank):
        loader = TorchLoader(env["client"], _spec(env, rank=rank, world_size=3, seed=5), epoch=2)
        batches = list(loader)
        assert len(batches) == len(loader)
        assert all(b["index"].dtype == torch.int64 for b in batches)
        return batches

    check_exactly_once(env, rank_batches, _np)


@pytest.mark.slow
def test_elastic_resume_3_to_2_and_2_to_4_ranks(env):
    """Every rank's state_dict() through torch.save/torch.load; a run of another world
    size loads the list and finishes the epoch: each sample exactly once."""
    def save(state):
        buf = io.BytesIO()
        torch.save({"loader": state}, buf)
        buf.seek(0)
        return torch.load(buf)["loader"]  # weights_only: plain values only

    def make(spec):
        loader = TorchLoader(env["client"], spec)
        loader.set_epoch(1)
        return loader

    check_elastic_resume(env, make, save, _np)


@pytest.mark.slow
def test_resume_continues_exactly(env):
    spec = _spec(env, seed=11, prefetch=4)
    full = TorchLoader(env["client"], spec)
    full.set_epoch(1)
    reference = list(full)

    first = TorchLoader(env["client"], spec)
    first.set_epoch(1)
    head = take(first, 5)
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
    assert_resumed(head, tail, reference, len(second), _np)
    assert second.state_dict()["iterator"]["position"] == len(reference)

    # another epoch drops the loaded position; a state of another spec is refused when loaded
    check_other_epoch_and_spec(env, lambda s: TorchLoader(env["client"], s), spec, state, 2, to_numpy=_np)


@pytest.mark.slow
def test_epoch_moves_only_with_set_epoch(env):
    loader = TorchLoader(env["client"], _spec(env, seed=2))
    assert len(cat(list(loader), "index", _np)) == N
    done = loader.state_dict()  # a finished pass stays at its epoch, reported as done
    assert done["epoch"] == 0 and done["iterator"]["position"] == len(loader)
    assert len(cat(list(loader), "index", _np)) == N  # the next pass: the same epoch again

    resumed = TorchLoader(env["client"], _spec(env, seed=2))
    resumed.load_state_dict(done)
    assert list(resumed) == []  # nothing of epoch 0 is left
    assert len(cat(list(resumed), "index", _np)) == N  # a loaded position serves one pass


@pytest.mark.slow
def test_folder_source_gives_lists_of_uint8_tensors(env):
    batches = list(TorchLoader(env["client"], folder_spec(env)))
    for b in batches:
        assert isinstance(b["data"], list) and all(t.dtype == torch.uint8 for t in b["data"])
    check_folder_batches(env, batches, _np)


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

@pytest.fixture
def gloo_group():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                         rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_rank_and_world_size_from_torch_distributed(env, gloo_group, monkeypatch):
    loader = TorchLoader(env["client"], _spec(env))
    assert (loader.spec.rank, loader.spec.world_size) == (0, 1)
    assert len(cat(list(loader), "index", _np)) == N

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
    np.testing.assert_array_equal(cat(list(adopted), "index", _np), cat(list(explicit), "index", _np))
    with pytest.raises(ValueError, match="rank=1, world_size=3"):
        TorchLoader(env["client"], _spec(env, rank=1, world_size=3))
