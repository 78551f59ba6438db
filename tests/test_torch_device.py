"""TorchLoader's device path (`dmdask.integrations._device`), on a machine without a GPU:
a CUDA device is refused clearly, the CPU path is unchanged, the prefetch keeps order and
depth, and the CUDA feeder's protocol (pin, non_blocking copy on its own stream, wait on
the current stream, record_stream) checked against a recording stand-in for torch.cuda."""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
import distributed  # noqa: E402

import dmdask  # noqa: E402
from dmdask.integrations import _device  # noqa: E402
from dmdask.integrations.torch import TorchLoader, to_torch  # noqa: E402
from dmdask.testing.datasets import write_blobs  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_prefetched_keeps_order_and_starts_depth_ahead():
    log = []

    def start(i):
        log.append(("start", i))
        return i * 10

    for depth in (0, 1, 3):
        log.clear()
        out = []
        for value in _device.prefetched(range(5), start, lambda v: v + 1, depth):
            out.append(value)
            started = sum(1 for e in log if e[0] == "start")
            assert started == min(5, len(out) + depth)  # never more than depth ahead of what was handed out
        assert out == [1, 11, 21, 31, 41]
    with pytest.raises(ValueError, match="device_prefetch must be 0 or more"):
        list(_device.prefetched([1], start, lambda v: v, -1))


@no_cuda
def test_a_cuda_device_without_cuda_is_refused_clearly_before_anything_starts():
    spec = dmdask.Spec(source="unused.zarr", batch_size=4)
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(RuntimeError, match=r"CUDA is not available here .*Leave device=None"):
            TorchLoader(None, spec, device=device)  # refused before the client is used
    with pytest.raises(ValueError, match="device_prefetch must be 0 or more"):
        TorchLoader(None, spec, device_prefetch=-1)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("device") / "train.zarr")
    write_blobs(path, n=300, features=4)
    with dmdask.LocalCluster(n_workers=1, processes=False, ram="16 MiB", ssd=0) as cluster, \
            distributed.Client(cluster) as client:
        yield client, dmdask.Spec(source=path, batch_size=32, seed=3)
        dmdask.release(client, dmdask.Spec(source=path, batch_size=32))


@pytest.mark.filterwarnings("ignore:no dmdask worker on this node")  # an in-process worker
@pytest.mark.parametrize("device", [None, "cpu"])
def test_the_cpu_path_is_unchanged(small, device):
    client, spec = small
    expected = [to_torch(b) for b in dmdask.batches(client, spec, epoch=1)]
    loader = TorchLoader(client, spec, device=device, epoch=1)
    assert loader.pin_memory is False
    got = list(loader)
    assert len(got) == len(expected) == len(loader)
    for a, b in zip(got, expected):
        assert set(a) == set(b)
        for name in a:
            assert a[name].device.type == "cpu" and torch.equal(a[name], b[name])


class _FakeCuda:
    """Records what the feeder asks of torch.cuda (streams, events, waits)."""

    def __init__(self):
        self.log = []
        self.current_stream_obj = types.SimpleNamespace(name="current",
                                                        wait_event=lambda e: self.log.append(("wait", e.n)))
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.name = "copy"

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.n = Event.count

            def record(self, stream):
                fake.log.append(("record", self.n, stream.name))

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                fake.log.append(("enter", self.stream.name))

            def __exit__(self, *exc):
                fake.log.append(("exit", self.stream.name))

        self.Stream, self.Event, self.stream = Stream, Event, StreamContext
        self.current_stream = lambda device=None: self.current_stream_obj


class _FakeTensor:
    def __init__(self, log, name, pinned=False, device="cpu"):
        self.log, self.name, self.pinned, self.device = log, name, pinned, device

    def is_pinned(self):
        return self.pinned

    def pin_memory(self):
        self.log.append(("pin", self.name))
        return _FakeTensor(self.log, self.name, pinned=True)

    def to(self, device, non_blocking=False):
        self.log.append(("to", self.name, str(device), non_blocking, self.pinned))
        return _FakeTensor(self.log, self.name, device=str(device))

    def record_stream(self, stream):
        self.log.append(("record_stream", self.name, stream.name))


def test_cuda_feeder_protocol_with_a_recording_torch():
    cuda = _FakeCuda()
    fake_torch = types.SimpleNamespace(cuda=cuda, Tensor=_FakeTensor)
    feeder = _device.CudaFeeder(fake_torch, "cuda:0", depth=1)
    batches = [{"x": _FakeTensor(cuda.log, f"x{i}"), "ragged": [_FakeTensor(cuda.log, f"r{i}")], "n": i}
               for i in range(3)]
    out = []
    for batch in feeder(iter(batches)):
        out.append(batch)
        # the current stream waited on this batch's copy before it was handed out
        assert ("wait", len(out)) in cuda.log
    assert [b["n"] for b in out] == [0, 1, 2]
    assert all(b["x"].device == "cuda:0" and b["ragged"][0].device == "cuda:0" for b in out)
    copies = [e for e in cuda.log if e[0] == "to"]
    assert copies and all(e[3] is True and e[4] is True for e in copies)  # non_blocking, from pinned memory
    i = cuda.log.index(("to", "x0", "cuda:0", True, True))
    assert ("enter", "copy") in cuda.log[:i] and cuda.log.index(("exit", "copy")) > i  # on the copy stream
    assert cuda.log.index(("record", 1, "copy")) < cuda.log.index(("wait", 1))
    assert ("record_stream", "x0", "current") in cuda.log and ("record_stream", "r0", "current") in cuda.log
    # depth 1: batch 1's copy was started before batch 0 was handed out
    assert cuda.log.index(("to", "x1", "cuda:0", True, True)) < cuda.log.index(("wait", 1))


def test_ready_pinned_tensors_are_not_pinned_again():
    cuda = _FakeCuda()
    feeder = _device.CudaFeeder(types.SimpleNamespace(cuda=cuda, Tensor=_FakeTensor), "cuda:0", depth=0)
    list(feeder([{"x": _FakeTensor(cuda.log, "x", pinned=True)}]))
    assert not [e for e in cuda.log if e[0] == "pin"]
