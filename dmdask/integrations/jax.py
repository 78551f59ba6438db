"""JAX adapter: `JaxLoader`, this rank's dmdask batches as dicts of `jax.Array`, optionally
sharded (docs/frameworks.md). This module imports JAX and no other framework.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

import dmdask
from ._fields import converted
from ._passes import EpochPasses, described
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


def _put(arr: np.ndarray, sharding: Sharding | None, device):
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        if sharding is not None and not sharding.is_fully_addressable:  # a global array over processes
            return jax.make_array_from_process_local_data(sharding, arr)
        return jax.device_put(arr, sharding if sharding is not None else device)
    except TypeError:  # a dtype JAX lacks (float128, ...)
        return arr


def to_jax(batch: dict[str, Any], sharding: Sharding | None = None, device=None) -> dict[str, Any]:
    """One dmdask batch converted by `_fields.converted` to `jax.Array`s placed with
    `sharding` (across processes assembled by `jax.make_array_from_process_local_data`) or
    on `device`; variable-size samples on `device`, never sharded. "index" stays numpy
    int64 (exact without `jax_enable_x64`); strings and dtypes JAX lacks stay numpy.
    """
    return converted(batch, lambda arr: _put(arr, sharding, device), lambda arr: _put(arr, None, device),
                     index=False)


class JaxLoader(EpochPasses):
    """This rank's dmdask batches, epoch after epoch, as dicts of `jax.Array`.

    Guarantees: those of `EpochPasses` with moves_on=True; `state_dict()` holds plain values.

    spec: in a multi-process JAX run, rank and world size from JAX (`process_spec`).
    sharding: None (each array on `device`), "local" (`local_batch_sharding()`), or any
        `jax.sharding.Sharding` for the numeric fields. Sharded batches must divide
        evenly: `spec.drop_last=True` and a batch size the shards divide (ValueError if not).
    device: the device of unsharded arrays (default: JAX's default device).

    Not thread-safe.
    """

    def __init__(self, client, spec: dmdask.Spec, *, sharding: None | str | Sharding = None,
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
        return described("JaxLoader", self, sharding=self.sharding)


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
