"""JAX adapter: `JaxLoader`, this rank's dmdask batches as dicts of `jax.Array`, optionally sharded.

    loader = JaxLoader(client, dmdask.Spec(source="train.zarr", batch_size=256, drop_last=True),
                       sharding="local")          # each batch split over the local devices
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        for batch in loader:                       # {"x": jax.Array, ..., "index": numpy int64}
            params, loss = train_step(params, batch["x"], batch["y"])
        checkpoint = {"params": params, "loader": loader.state_dict()}

dmdask prefetches `spec.prefetch` batches on the cluster, and `jax.device_put` copies
asynchronously. This module imports JAX and no other framework.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

import dmdask
from ._fields import converted
from ._passes import EpochPasses
from ._rank import spec_for_rank

__all__ = ["JaxLoader", "to_jax", "local_batch_sharding", "process_spec"]


def process_spec(spec: dmdask.Spec) -> dmdask.Spec:
    """`spec` with rank and world size from a multi-process JAX run (`jax.process_index()`,
    `jax.process_count()`, by `_rank.spec_for_rank`); one process: unchanged."""
    if jax.process_count() == 1:
        return spec
    return spec_for_rank(spec, jax.process_index(), jax.process_count(), "JAX processes")


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
    return converted(batch, lambda arr: _put(arr, sharding, device), lambda arr: _put(arr, None, device),
                     index=False)


class JaxLoader(EpochPasses):
    """This rank's dmdask batches, epoch after epoch, as dicts of `jax.Array`.

    Guarantees: those of `EpochPasses` with moves_on=True: handing out the last batch of
    an epoch moves the loader to the next epoch, a pass abandoned part-way does not.
    `state_dict()` holds plain values (JSON, pickle, or beside the params in any format).

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
        super().__init__(client, spec, epoch)
        self.sharding = sharding
        self.device = device

    def __iter__(self):
        for batch in self.start_pass():
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
