"""Batches onto a CUDA device ahead of the training step (`TorchLoader(device="cuda:N")`).

Each tensor is pinned (torch's caching host allocator) and copied to the device with
`non_blocking=True` on a stream of its own, overlapping the training step; up to `depth`
batches are in flight. A batch is handed out only after the current stream waits for its
copy (`wait_event`), and its tensors are recorded on that stream, so the allocator never
reuses their memory early.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
U = TypeVar("U")

__all__ = ["CudaFeeder", "check_device", "prefetched"]


def prefetched(items: Iterable[T], start: Callable[[T], U], finish: Callable[[U], Any], depth: int) -> Iterator:
    """`finish(start(item))` for each item, in order, with `start` called up to `depth`
    items ahead of the one handed out (depth 0: one at a time)."""
    if depth < 0:
        raise ValueError(f"device_prefetch must be 0 or more, got {depth}")
    started: deque = deque()
    for item in items:
        started.append(start(item))
        if len(started) > depth:
            yield finish(started.popleft())
    while started:
        yield finish(started.popleft())


def check_device(torch, device) -> bool:
    """Whether `device` (a torch.device) takes the CUDA path; RuntimeError, saying what to
    do instead, when it is a CUDA device and this process has no CUDA."""
    if device is None or device.type != "cuda":
        return False
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else "no CUDA device visible"
        raise RuntimeError(
            f"TorchLoader(device={str(device)!r}): CUDA is not available here ({build}: torch.cuda.is_available() "
            "is False). Leave device=None (or 'cpu') for batches in host memory, or run on a GPU node "
            "(check CUDA_VISIBLE_DEVICES and that torch was installed with CUDA)")
    return True


class CudaFeeder:
    """Hands host batches (dicts of tensors, lists of tensors, other values) out on
    `device`, `depth` batches ahead, as described in the module's docstring."""

    def __init__(self, torch, device, depth: int = 2):
        self.torch = torch
        self.device = device
        self.depth = int(depth)
        self.stream = torch.cuda.Stream(device=device)

    def __call__(self, batches: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        return prefetched(batches, self._start, self._finish, self.depth)

    def _start(self, batch: dict[str, Any]):
        torch = self.torch
        with torch.cuda.stream(self.stream):
            out = {name: [self._copy(v) for v in value] if isinstance(value, list) else self._copy(value)
                   for name, value in batch.items()}
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def _copy(self, value):
        if not isinstance(value, self.torch.Tensor):
            return value
        host = value if value.is_pinned() else value.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _finish(self, started):
        out, done = started
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for value in out.values():
            for tensor in value if isinstance(value, list) else [value]:
                if isinstance(tensor, self.torch.Tensor):
                    tensor.record_stream(current)
        return out
