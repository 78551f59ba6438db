"""JAX adapter: `JaxLoader`, this rank's dmdask batches as dicts of `jax.Array`, optionally sharded.

    loader = JaxLoader(client, dmdask.Spec(source="train.zarr", batch_size=256, drop_last=True),
                       sharding="local")          # each batch split over the local devices
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        for batch in loader:                       # {"x": jax.Array, ..., "index": numpy int64}
            params, loss = train_step(params, batch["x"], batch["y"])
        checkpoint = {"params": params, "loader": loader.state_dict()}

Handing out the last batch of an epoch moves the loader on to the next epoch, so a loop
without `set_epoch` also goes epoch after epoch. dmdask prefetches `spec.prefetch`
batches on the cluster, and `jax.device_put` copies asynchronously.
This module imports JAX and no other framework.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

import dmdask

__all__ = ["JaxLoader", "to_jax", "local_batch_sharding", "process_spec"]


def process_spec(spec: dmdask.Spec) -> dmdask.Spec:
    """`spec` with rank and world size from a multi-process JAX run (`jax.process_index()`,
    `jax.process_count()`, after `jax.distributed.initialize()`); one process: unchanged.

    As in `integrations.torch.distributed_spec`: a spec at the defaults rank=0,
    world_size=1 takes JAX's values; explicit values must agree (ValueError).
    """
    rank, world_size = jax.process_index(), jax.process_count()
    if world_size == 1:
        return spec
    if (spec.rank, spec.world_size) == (0, 1):
        return spec.replace(rank=rank, world_size=world_size)
    if (spec.rank, spec.world_size) != (rank, world_size):
        raise ValueError(
            f"Spec(rank={spec.rank}, world_size={spec.world_size}) disagrees with JAX "
            f"(process {rank} of {world_size}); leave the spec's rank and world_size at "
            "their defaults to take them from jax.process_index()/process_count()"
        )
    return spec


def local_batch_sharding(axis: str = "batch") -> NamedSharding:
    """Split the first (batch) axis over this process's devices: a one-axis `Mesh` of
    `jax.local_devices()` and `PartitionSpec(axis)`."""
    return NamedSharding(Mesh(np.array(jax.local_devices()), (axis,)), PartitionSpec(axis))


def _put(arr: np.ndarray, sharding: Optional[Sharding], device):
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        if sharding is not None and not sharding.is_fully_addressable:  # a global array over processes
            return jax.make_array_from_process_local_data(sharding, arr)
        return jax.device_put(arr, sharding if sharding is not None else device)
    except TypeError:  # a dtype JAX lacks (float128, ...)
        return arr


def to_jax(batch: Dict[str, Any], sharding: Optional[Sharding] = None, device=None) -> Dict[str, Any]:
    """Convert one dmdask batch (dict of numpy arrays) to JAX.

    - numeric arrays -> `jax.Array`, placed with `sharding` (the batch axis split over
      its devices; across processes, `jax.make_array_from_process_local_data` assembles
      the global batch) or on `device` (default: JAX's default device). Without
      `jax_enable_x64`, JAX stores 64-bit values as 32-bit ones (its usual rule);
    - object arrays (variable-size samples, e.g. the uint8 bytes of a file folder) ->
      a list with one `jax.Array` per sample, on `device` (never sharded);
    - "index" -> stays a numpy int64 array of global sample ids (exact without x64,
      and host-side where bookkeeping needs it);
    - strings and dtypes JAX lacks pass through as numpy.
    """
    out: Dict[str, Any] = {}
    for name, value in batch.items():
        if name == "index":
            out[name] = np.asarray(value).astype(np.int64, copy=False)
        elif not isinstance(value, np.ndarray) or value.dtype.kind in "USV":
            out[name] = value
        elif value.dtype == object:
            out[name] = [_put(v, None, device) if isinstance(v, np.ndarray) and v.dtype != object else v
                         for v in value]
        else:
            out[name] = _put(value, sharding, device)
    return out


# --- epochs, passes and positions: the same code in integrations/{tensorflow,mxnet,jax}.py ---

class _EpochPasses:
    """The epoch bookkeeping of a loader over `dmdask.batches`.

    A pass yields the batches of the current epoch from its start point (the epoch's
    first batch, or the position given to `load_state_dict`). Handing out the last batch
    of the epoch moves the loader to the next epoch at once (a consumer that stops
    after a known number of steps still moves on); a pass abandoned part-way leaves the
    epoch and its start point as they were. `set_epoch` picks an epoch explicitly.
    """

    def _init_passes(self, client, spec: dmdask.Spec, epoch: int) -> None:
        self.client = client
        self.spec = spec
        self.epoch = _check_epoch(epoch)
        self._lock = threading.RLock()
        self._start: Optional[dict] = None  # inner state each pass of this epoch starts from
        self._fresh: Optional[dmdask.BatchIterator] = None  # built (by len/load) but not started
        self._current: Optional[dmdask.BatchIterator] = None  # the latest pass of this epoch

    def set_epoch(self, epoch: int) -> None:
        """Iterate `epoch` on the next pass. The epoch the loader is already at changes
        nothing (a loaded position survives); another epoch starts at its first batch."""
        epoch = _check_epoch(epoch)
        with self._lock:
            if epoch != self.epoch:
                self._close_all()
                self._start = None
                self.epoch = epoch

    def __len__(self) -> int:
        """Batches this rank gets per epoch (a resumed pass yields only the rest)."""
        with self._lock:
            if self._current is not None:
                return len(self._current)
            if self._fresh is None:
                self._fresh = self._make()
            return len(self._fresh)

    def _make(self) -> dmdask.BatchIterator:
        return dmdask.batches(self.client, self.spec, epoch=self.epoch, resume=self._start)

    def _pass(self, repeat: bool = False):
        """One pass: numpy batches of the current epoch; repeat=True goes on with the
        following epochs without end."""
        with self._lock:
            it = self._fresh if self._fresh is not None else self._make()
            self._fresh = None
            if self._current is not None and self._current is not it:
                self._current.close()
            self._current = it
        try:
            while True:
                count, owner = 0, True
                for batch in it:
                    count += 1
                    last = it.state_dict()["position"] >= len(it)
                    if last:  # the epoch is done once its last batch is handed out
                        owner = self._advance(it)
                    yield batch
                    if last:
                        break
                else:
                    if it.state_dict()["position"] < len(it):  # closed part-way
                        return
                    owner = self._advance(it)  # a pass that started at the end of its epoch
                if not owner or not (repeat or count == 0):
                    return
                with self._lock:
                    if self._current is not None:  # another pass or set_epoch took over
                        return
                    it = self._current = self._make()
        finally:
            it.close()  # cancels prefetched batches; the position stays at the last one handed out

    def _advance(self, it: dmdask.BatchIterator) -> bool:
        """Move on to the next epoch after `it`, if `it` is still this loader's pass."""
        with self._lock:
            if self._current is not it:
                return False
            self.epoch += 1
            self._start = None
            self._current = None
            return True

    def state_dict(self) -> dict:
        """{"epoch": int, "iterator": dmdask state or None}: plain values (JSON, pickle)."""
        with self._lock:
            if self._current is not None:
                inner = self._current.state_dict()
            else:
                inner = dict(self._start) if self._start is not None else None
            return {"epoch": self.epoch, "iterator": inner}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (of a loader of the same dataset, spec and rank): sets the
        epoch, and each pass of that epoch starts right after the batches handed out
        when the state was taken. Another dataset, spec or rank raises
        `dmdask.SpecError` (a ValueError) here."""
        if not isinstance(state, dict) or "epoch" not in state or "iterator" not in state:
            raise ValueError(f"state must be a dict from {type(self).__name__}.state_dict()")
        epoch = _check_epoch(state["epoch"])
        inner = state["iterator"]
        if inner is not None:
            if not isinstance(inner, dict):
                raise ValueError("state['iterator'] must be None or a dmdask BatchIterator state")
            if inner.get("epoch") != epoch:
                raise ValueError(f"inconsistent state: epoch {epoch} but iterator epoch {inner.get('epoch')!r}")
            inner = dict(inner)
        with self._lock:
            self._close_all()
            self.epoch = epoch
            self._start = inner
            self._fresh = self._make()  # validates the state against this loader's spec now

    def _close_all(self) -> None:
        for it in (self._current, self._fresh):
            if it is not None:
                it.close()
        self._current = self._fresh = None

    def close(self) -> None:
        """Cancel batches in flight. The loader stays usable: the next pass starts anew."""
        with self._lock:
            if self._current is not None:
                self._current.close()  # kept: state_dict() still reports its position
            if self._fresh is not None:
                self._fresh.close()
                self._fresh = None

    def _peek(self) -> dict:
        """One batch of the current epoch, from a separate iterator (no position moves)."""
        probe = dmdask.batches(self.client, self.spec.replace(prefetch=1), epoch=self.epoch)
        try:
            return next(iter(probe))
        finally:
            probe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_epoch(epoch) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    return int(epoch)


class JaxLoader(_EpochPasses):
    """This rank's dmdask batches, epoch after epoch, as dicts of `jax.Array`.

    Guarantees (from `dmdask.batches`):
    - a pass (`for batch in loader`) yields the batches of the current epoch in the
      order fixed by (seed, epoch); across `world_size` ranks every sample of an epoch
      is yielded exactly once;
    - handing out the last batch of an epoch moves the loader to the next epoch; a
      pass abandoned part-way does not (the next pass starts that epoch again from its
      start point: its first batch, or the loaded position); `set_epoch(e)` picks an
      epoch explicitly (the usual `set_epoch(epoch)` at the top of the loop agrees);
    - `len(loader)` is the number of batches this rank gets per epoch;
    - `state_dict()` records the epoch and the batches handed out, as plain values
      (JSON, pickle, or beside the params in any checkpoint format);
      `load_state_dict()` continues right after them with the batches an
      uninterrupted run would give.

    client: a `distributed.Client` of a cluster of dmdask workers.
    spec: a `dmdask.Spec`. In a multi-process JAX run its rank and world size come from
        JAX when left at the defaults (see `process_spec`).
    sharding: None (each array on `device`), "local" (the batch axis split over this
        process's devices, `local_batch_sharding()`), or any `jax.sharding.Sharding`
        for the numeric fields; a sharding over several processes assembles each global
        batch from every process's rows. Sharded batches must divide evenly: use
        `spec.drop_last=True` and a batch size the shards divide (ValueError if not).
    device: the device of unsharded arrays (default: JAX's default device).
    epoch: the first epoch.

    One pass at a time; not thread-safe.
    """

    def __init__(self, client, spec: dmdask.Spec, *, sharding: Union[None, str, Sharding] = None,
                 device=None, epoch: int = 0):
        if not isinstance(spec, dmdask.Spec):
            raise TypeError(f"spec must be a dmdask.Spec, got {type(spec).__name__}")
        spec = process_spec(spec)
        if isinstance(sharding, str):
            if sharding != "local":
                raise ValueError(f"sharding must be None, 'local' or a jax.sharding.Sharding, got {sharding!r}")
            sharding = local_batch_sharding()
        if sharding is not None:
            if not isinstance(sharding, Sharding):
                raise TypeError(f"sharding must be None, 'local' or a jax.sharding.Sharding, got {sharding!r}")
            shards = _batch_shards(sharding)
            if not spec.drop_last or spec.batch_size % shards:
                raise ValueError(f"sharding splits each batch into {shards} parts: use "
                                 f"Spec(drop_last=True) and a batch_size that {shards} divides "
                                 f"(got batch_size={spec.batch_size}, drop_last={spec.drop_last})")
        self._init_passes(client, spec, epoch)
        self.sharding = sharding
        self.device = device

    def __iter__(self):
        for batch in self._pass():
            yield to_jax(batch, self.sharding, self.device)

    def __repr__(self) -> str:
        s = self.spec
        return (f"JaxLoader(source={s.source!r}, batch_size={s.batch_size}, rank={s.rank}, "
                f"world_size={s.world_size}, epoch={self.epoch}, sharding={self.sharding})")


def _batch_shards(sharding: Sharding) -> int:
    """Into how many pieces `sharding` cuts this process's rows of a batch (1 when it
    cannot tell: device_put then reports an uneven batch itself)."""
    ndim = max(1, len(getattr(sharding, "spec", ()) or ()))
    size = len(sharding.device_set)  # every mesh axis divides it
    try:
        indices = sharding.addressable_devices_indices_map((size,) * ndim).values()
    except Exception:
        return 1
    return max(1, len({(index[0].start, index[0].stop) for index in indices}))
