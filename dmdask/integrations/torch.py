"""PyTorch adapter: `TorchLoader`, a DataLoader-like iterable over dmdask batches (docs/frameworks.md).

Use it in place of a `torch.utils.data.DataLoader`, not inside one: in a DataLoader
worker (each would replay the whole epoch) it raises RuntimeError.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed
import torch.utils.data

import dmdask
from ._device import CudaFeeder, check_device
from ._fields import converted
from ._passes import EpochPasses, described
from ._rank import spec_for_rank

__all__ = ["TorchLoader", "EpochSampler", "to_torch", "distributed_spec"]

# numpy kinds torch.from_numpy takes: bool, signed, unsigned, float, complex
_NUMERIC_KINDS = "biufc"


def distributed_spec(spec: dmdask.Spec) -> dmdask.Spec:
    """`spec` with rank and world size from `torch.distributed` (by `_rank.spec_for_rank`, for
    any group size) when it is initialised; otherwise `spec` unchanged."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return spec
    return spec_for_rank(spec, torch.distributed.get_rank(), torch.distributed.get_world_size(),
                         "torch.distributed")


def _tensor(arr: np.ndarray):
    """A tensor sharing `arr`'s memory when torch can; a copy when `arr` is read-only,
    non-native-endian or negatively strided; `arr` itself for non-numeric dtypes."""
    if arr.dtype.kind not in _NUMERIC_KINDS:
        return arr
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if not arr.flags.writeable or any(s < 0 for s in arr.strides):
        arr = np.array(arr, order="C")  # torch tensors are always writable: never alias read-only memory
    try:
        return torch.from_numpy(arr)
    except TypeError:  # a numeric dtype torch lacks (e.g. float128)
        return arr


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    """One dmdask batch converted by `_fields.converted` to torch tensors that share the numpy
    memory (see `_tensor`); "index" an int64 tensor; what torch cannot represent unchanged."""
    return converted(batch, _tensor)


class EpochSampler:
    """A `TorchLoader`'s `sampler`: what trainers that follow the DataLoader convention
    (Lightning's `Trainer`, Accelerate) call `set_epoch` on at the start of each epoch; it
    sets the loader's epoch. The loader itself deals the samples: this yields none."""

    def __init__(self, loader: TorchLoader):
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader) * self.loader.spec.batch_size

    def __iter__(self):
        raise TypeError("a TorchLoader's sampler only carries set_epoch: iterate the TorchLoader itself")


class TorchLoader(EpochPasses):
    """This rank's batches of `spec.source`, epoch by epoch, as dicts of torch tensors.

    Guarantees: those of `EpochPasses` with moves_on=False (as with `DistributedSampler`).
    `state_dict()` holds plain values (for `torch.load(weights_only=True)` and JSON).

    spec: rank and world size from torch.distributed (`distributed_spec`), once, here.
    pin_memory: pin tensors in page-locked memory; a no-op without CUDA. A CUDA `device` always pins.
    device: None (default): host memory. A CUDA device ("cuda:1"): copied on a stream of
        their own, `device_prefetch` batches ahead of the training step (`_device.CudaFeeder`);
        without CUDA, RuntimeError, here. Any other device: tensors moved there with `.to`.
    device_prefetch: batches in flight on a CUDA device (0: one at a time).

    With DistributedDataParallel, set `spec.drop_last=True` so that every rank takes the
    same number of steps per epoch. Under Lightning's `Trainer` (and other trainers that
    call `loader.sampler.set_epoch(e)` each epoch, as for a `DistributedSampler`) the
    epoch follows the trainer's (`sampler`: an `EpochSampler`). Not thread-safe.
    """

    def __init__(self, client, spec: dmdask.Spec, *, pin_memory: bool = False,
                 device: str | torch.device | None = None, device_prefetch: int = 2, epoch: int = 0):
        if not isinstance(spec, dmdask.Spec):
            raise TypeError(f"spec must be a dmdask.Spec, got {type(spec).__name__}")
        if int(device_prefetch) < 0:
            raise ValueError(f"device_prefetch must be 0 or more (batches in flight on the device), "
                             f"got {device_prefetch}")
        self.device = torch.device(device) if device is not None else None
        cuda = check_device(torch, self.device)  # before anything starts: a clear error without CUDA
        self.device_prefetch = int(device_prefetch)
        super().__init__(client, distributed_spec(spec), epoch, moves_on=False)
        self.pin_memory = cuda or (bool(pin_memory) and torch.cuda.is_available())
        self._feeder = CudaFeeder(torch, self.device, self.device_prefetch) if cuda else None
        self.sampler = EpochSampler(self)

    def __iter__(self):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "TorchLoader cannot run inside a DataLoader worker process: it prefetches on "
                "the Dask cluster itself; iterate it directly in the training process"
            )
        batches = self.start_pass()  # starts the pass here, at iter()
        if self._feeder is not None:
            return self._feeder(to_torch(batch) for batch in batches)
        return (self._place(to_torch(batch)) for batch in batches)

    def _place(self, batch: dict[str, Any]) -> dict[str, Any]:
        if not (self.pin_memory or self.device is not None):
            return batch
        return {name: [self._move(v) for v in value] if isinstance(value, list) else self._move(value)
                for name, value in batch.items()}

    def _move(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        if self.pin_memory:
            value = value.pin_memory()
        if self.device is not None:
            value = value.to(self.device, non_blocking=self.pin_memory)
        return value

    def __repr__(self) -> str:
        return described("TorchLoader", self, pin_memory=self.pin_memory, device=self.device)
