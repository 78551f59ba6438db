"""PyTorch adapter: `TorchLoader`, a DataLoader-like iterable over dmdask batches.

    loader = TorchLoader(client, dmdask.Spec(source="train.zarr", batch_size=256))
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        for batch in loader:          # dict[str, torch.Tensor]
            loss = step(batch["x"], batch["y"])
        torch.save({"loader": loader.state_dict(), ...}, "ckpt.pt")

Use it in place of a `torch.utils.data.DataLoader`, not inside one: dmdask prefetches
`spec.prefetch` batches on the cluster; in a DataLoader worker (each would replay the
whole epoch) it raises RuntimeError.
"""
from __future__ import annotations

from typing import Any, Dict, Union

import numpy as np
import torch
import torch.distributed
import torch.utils.data

import dmdask
from ._device import CudaFeeder, check_device
from ._fields import converted
from ._passes import EpochPasses
from ._rank import spec_for_rank

__all__ = ["TorchLoader", "to_torch", "distributed_spec"]

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


def to_torch(batch: Dict[str, Any]) -> Dict[str, Any]:
    """Convert one dmdask batch (dict of numpy arrays) to torch, without copies where possible.

    - numeric arrays -> `torch.from_numpy` (shares memory; copied only if read-only,
      byte-swapped or negatively strided);
    - object arrays (variable-size samples, e.g. the uint8 bytes of a file folder) ->
      a list with one tensor per sample (non-array elements kept as they are);
    - "index" -> an int64 tensor of global sample ids;
    - anything torch cannot represent (strings, ...) is passed through unchanged.
    """
    return converted(batch, _tensor)


class TorchLoader(EpochPasses):
    """This rank's batches of `spec.source`, epoch by epoch, as dicts of torch tensors.

    Guarantees: those of `EpochPasses` with moves_on=False: the epoch changes only with
    `set_epoch` (as with `DistributedSampler`), and setting the epoch the loader is at
    keeps a loaded position. `state_dict()` holds plain Python values (for `torch.save`,
    `torch.load(weights_only=True)` and JSON).

    client: a `distributed.Client` of a cluster of dmdask workers.
    spec: a `dmdask.Spec`; rank and world size from torch.distributed (`distributed_spec`), once, here.
    pin_memory: pin tensors in page-locked memory for faster host-to-GPU copies. Only
        when `torch.cuda.is_available()`; on CPU-only builds or machines it is a no-op
        (pinning would raise there). A CUDA `device` always pins.
    device: where batches are handed out. None (default): host memory, as converted by
        `to_torch`. A CUDA device ("cuda:1", `dmdask.rank_from_environment().device`):
        copied on a stream of their own, `device_prefetch` batches ahead of the training
        step (`_device.CudaFeeder`); without CUDA, RuntimeError, here. Any other device
        ("cpu"): tensors moved there with `.to`.
    device_prefetch: batches in flight on a CUDA device (default 2; 0: one at a time).
    epoch: the first epoch.

    With DistributedDataParallel, set `spec.drop_last=True` so that every rank takes the
    same number of steps per epoch. One pass at a time: a new `iter()` closes the previous
    one. Not thread-safe.
    """

    def __init__(self, client, spec: dmdask.Spec, *, pin_memory: bool = False,
                 device: Union[str, torch.device, None] = None, device_prefetch: int = 2, epoch: int = 0):
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

    def _place(self, batch: Dict[str, Any]) -> Dict[str, Any]:
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
        s = self.spec
        return (f"TorchLoader(source={s.source!r}, batch_size={s.batch_size}, rank={s.rank}, "
                f"world_size={s.world_size}, epoch={self.epoch}, pin_memory={self.pin_memory}, "
                f"device={self.device})")
