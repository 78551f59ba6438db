"""PyTorch adapter: `TorchLoader`, a DataLoader-like iterable over dmdask batches.

    loader = TorchLoader(client, dmdask.Spec(source="train.zarr", batch_size=256))
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        for batch in loader:          # dict[str, torch.Tensor]
            loss = step(batch["x"], batch["y"])
        torch.save({"loader": loader.state_dict(), ...}, "ckpt.pt")

Use it in place of a `torch.utils.data.DataLoader`, not inside one: dmdask already
prefetches `spec.prefetch` batches on the cluster while the loop computes, so no
DataLoader worker processes are needed. Iterating it in a DataLoader worker subprocess
is not supported (each worker would replay the whole epoch) and raises RuntimeError.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import numpy as np
import torch
import torch.distributed
import torch.utils.data

import dmdask

__all__ = ["TorchLoader", "to_torch", "distributed_spec"]

# numpy kinds torch.from_numpy takes: bool, signed, unsigned, float, complex
_NUMERIC_KINDS = "biufc"


def distributed_spec(spec: dmdask.Spec) -> dmdask.Spec:
    """`spec` with rank and world size taken from `torch.distributed` when it is initialised.

    - torch.distributed not available or not initialised: `spec` unchanged.
    - spec.rank/world_size at their defaults (0/1): a copy with torch.distributed's
      rank and world size (an explicit rank=0, world_size=1 counts as the defaults).
    - otherwise they must equal torch.distributed's; ValueError naming both if not.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return spec
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if (spec.rank, spec.world_size) == (0, 1):
        if (rank, world_size) == (0, 1):
            return spec
        return spec.replace(rank=rank, world_size=world_size)
    if (spec.rank, spec.world_size) != (rank, world_size):
        raise ValueError(
            f"Spec(rank={spec.rank}, world_size={spec.world_size}) disagrees with "
            f"torch.distributed (rank={rank}, world_size={world_size}); leave the spec's "
            "rank and world_size at their defaults to take them from torch.distributed"
        )
    return spec


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
    out: Dict[str, Any] = {}
    for name, value in batch.items():
        if name == "index":
            value = np.asarray(value).astype(np.int64, copy=False)
        if not isinstance(value, np.ndarray):
            out[name] = value
        elif value.dtype == object:
            out[name] = [_tensor(v) if isinstance(v, np.ndarray) and v.dtype != object else v
                         for v in value]
        else:
            out[name] = _tensor(value)
    return out


class TorchLoader:
    """This rank's batches of `spec.source`, epoch by epoch, as dicts of torch tensors.

    Guarantees (from `dmdask.batches`):
    - each iteration yields the batches of the current epoch (see `set_epoch`) in a
      fixed order given by (seed, epoch); across `world_size` ranks every sample of an
      epoch is yielded exactly once;
    - `len(loader)` is the number of batches this rank gets per epoch;
    - `state_dict()` records the epoch and the number of batches handed out; a new
      loader given `load_state_dict(state)` continues right after the last batch handed
      out, with the same batches an uninterrupted run would yield.

    client: a `distributed.Client` of a cluster of dmdask workers.
    spec: a `dmdask.Spec`. If its rank/world_size are left at 0/1 and torch.distributed
        is initialised, they are taken from torch.distributed (see `distributed_spec`);
        explicit values that disagree with it raise ValueError. Resolved once, here.
    pin_memory: pin tensors in page-locked memory for faster host-to-GPU copies. Only
        when `torch.cuda.is_available()`; on CPU-only builds or machines it is a no-op
        (pinning would raise there).
    device: move tensors there (e.g. "cuda:0"), non-blocking when pinned.
    epoch: the first epoch.

    With DistributedDataParallel, set `spec.drop_last=True` so that every rank takes the
    same number of steps per epoch.

    Batches are prefetched on the cluster (`spec.prefetch` in flight); do not wrap the
    loader in a DataLoader. One pass at a time: a new `iter()` closes the previous one.
    Not thread-safe.
    """

    def __init__(self, client, spec: dmdask.Spec, *, pin_memory: bool = False,
                 device: Union[str, torch.device, None] = None, epoch: int = 0):
        if not isinstance(spec, dmdask.Spec):
            raise TypeError(f"spec must be a dmdask.Spec, got {type(spec).__name__}")
        self.client = client
        self.spec = distributed_spec(spec)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.device = torch.device(device) if device is not None else None
        self.epoch = _check_epoch(epoch)
        self._resume: Optional[dict] = None  # inner state to continue from, for the next pass
        self._fresh: Optional[dmdask.BatchIterator] = None  # built (by len/load) but not started
        self._current: Optional[dmdask.BatchIterator] = None  # the pass of this epoch under way

    # -- epochs ------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use `epoch`'s order for the next pass (like `DistributedSampler.set_epoch`).

        Setting the epoch the loader is already at changes nothing, so a state loaded
        with `load_state_dict` survives the usual `set_epoch(epoch)` at the top of the loop;
        another epoch drops it and starts that epoch from its first batch.
        """
        epoch = _check_epoch(epoch)
        if epoch != self.epoch:
            self._close_all()
            self._resume = None
            self.epoch = epoch

    def __len__(self) -> int:
        if self._current is not None:
            return len(self._current)
        if self._fresh is None:
            self._fresh = self._make()
        return len(self._fresh)

    def __iter__(self):
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "TorchLoader cannot run inside a DataLoader worker process: it prefetches on "
                "the Dask cluster itself; iterate it directly in the training process"
            )
        it = self._fresh if self._fresh is not None else self._make()
        self._fresh = None
        self._resume = None
        if self._current is not None:
            self._current.close()
        self._current = it
        return self._generate(it)

    def _generate(self, it: dmdask.BatchIterator):
        try:
            for batch in it:
                yield self._place(to_torch(batch))
        finally:
            it.close()  # cancels prefetched batches; the position stays at the last one handed out

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

    def _make(self) -> dmdask.BatchIterator:
        return dmdask.batches(self.client, self.spec, epoch=self.epoch, resume=self._resume)

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"epoch": int, "iterator": dmdask state or None}: plain Python values, fit
        for `torch.save` (and `torch.load(weights_only=True)`) and JSON."""
        if self._current is not None:
            inner = self._current.state_dict()
        else:
            inner = dict(self._resume) if self._resume is not None else None
        return {"epoch": self.epoch, "iterator": inner}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (of a loader of the same dataset, spec and rank).

        Sets the epoch; the next pass starts right after the last batch handed out when
        the state was taken. A state from another dataset, spec or rank raises
        `dmdask.SpecError` (a ValueError) here.
        """
        if not isinstance(state, dict) or "epoch" not in state or "iterator" not in state:
            raise ValueError("state must be a dict from TorchLoader.state_dict()")
        epoch = _check_epoch(state["epoch"])
        inner = state["iterator"]
        if inner is not None:
            if not isinstance(inner, dict):
                raise ValueError("state['iterator'] must be None or a dmdask BatchIterator state")
            if inner.get("epoch") != epoch:
                raise ValueError(f"inconsistent state: epoch {epoch} but iterator epoch {inner.get('epoch')!r}")
            inner = dict(inner)
        self._close_all()
        self.epoch = epoch
        self._resume = inner
        self._fresh = self._make()  # validates the state against this loader's spec now

    # -- closing -----------------------------------------------------------------------
    def _close_all(self) -> None:
        for it in (self._current, self._fresh):
            if it is not None:
                it.close()
        self._current = self._fresh = None

    def close(self) -> None:
        """Cancel batches in flight. The loader stays usable: the next pass starts anew."""
        if self._current is not None:
            self._current.close()  # keep it: state_dict() still reports its position
        if self._fresh is not None:
            self._fresh.close()
            self._fresh = None

    def __enter__(self) -> "TorchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.spec
        return (f"TorchLoader(source={s.source!r}, batch_size={s.batch_size}, rank={s.rank}, "
                f"world_size={s.world_size}, epoch={self.epoch}, pin_memory={self.pin_memory}, "
                f"device={self.device})")


def _check_epoch(epoch) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    return int(epoch)
