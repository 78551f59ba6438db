"""MXNet adapter: dmdask batches as a Gluon-style iterable of NDArrays and as an `mx.io.DataIter`.

    # Gluon: dicts of NDArray
    loader = MXNetLoader(client, dmdask.Spec(source="train.zarr", batch_size=256), ctx=mx.cpu())
    for epoch in range(start, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            with autograd.record():
                loss = loss_fn(net(batch["x"]), batch["y"])
            loss.backward()
            trainer.step(batch["x"].shape[0])

    # Module API: an mx.io.DataIter with provide_data / provide_label
    train = DmdaskDataIter(client, spec, data_names=("x",), label_names=("y",))
    mod = mx.mod.Module(symbol, data_names=("x",), label_names=("y",))
    mod.fit(train, num_epoch=5)                 # fit epoch k iterates dmdask epoch k

MXNet 1.9.1 (its last release) still uses `np.bool`, which numpy removed in 1.24, so
`import mxnet` fails with numpy 1.24-1.26. This module restores the alias (`numpy.bool =
bool`, only when numpy lacks it) before it imports mxnet: import it before mxnet. Use
numpy 1.26.x (`pip install numpy==1.26.4 mxnet==1.9.1`). It imports no other framework.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Sequence

import numpy as np

if "bool" not in np.__dict__:  # the MXNet 1.9.1 shim: np.bool was removed in numpy 1.24
    np.bool = bool
with warnings.catch_warnings():  # MXNet's import-time noise: distutils, numpy financial functions
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx  # noqa: E402

import dmdask  # noqa: E402
from ._fields import converted  # noqa: E402
from ._passes import EpochPasses  # noqa: E402
from ._rank import spec_for_rank  # noqa: E402

__all__ = ["MXNetLoader", "DmdaskDataIter", "to_mxnet", "kvstore_spec"]

# numpy dtypes NDArray holds, and lossless widenings for those it lacks
_MX_DTYPES = {np.dtype(t) for t in ("float16", "float32", "float64", "uint8", "int8", "int32", "int64", "bool")}
_WIDEN = {np.dtype("int16"): np.dtype("int32"), np.dtype("uint16"): np.dtype("int32"),
          np.dtype("uint32"): np.dtype("int64")}


def kvstore_spec(spec: dmdask.Spec, kvstore=None) -> dmdask.Spec:
    """`spec` with rank and world size from a distributed `mx.kv.KVStore` (`kv.rank`,
    `kv.num_workers`, by `_rank.spec_for_rank`); None or a store of one worker: unchanged."""
    if kvstore is None or int(kvstore.num_workers) == 1:
        return spec
    return spec_for_rank(spec, kvstore.rank, kvstore.num_workers, "the kvstore")


def _mx_dtype(dtype: np.dtype) -> np.dtype:
    """`dtype` in native byte order, widened where NDArray lacks it."""
    return _WIDEN.get(dtype.newbyteorder("="), dtype.newbyteorder("="))


def _ndarray(arr: np.ndarray, ctx):
    dtype = _mx_dtype(arr.dtype)
    if dtype not in _MX_DTYPES:
        return arr  # complex, uint64, float128, ...: left as numpy
    return mx.nd.array(np.ascontiguousarray(arr, dtype=dtype), ctx=ctx, dtype=dtype)


def to_mxnet(batch: Dict[str, Any], ctx=None) -> Dict[str, Any]:
    """Convert one dmdask batch (dict of numpy arrays) to MXNet NDArrays on `ctx`
    (default: `mx.cpu()`), copying.

    - numeric arrays -> `NDArray` of the same dtype (int16/uint16 widened to int32,
      uint32 to int64; dtypes NDArray lacks stay numpy);
    - object arrays (variable-size samples, e.g. the uint8 bytes of a file folder) ->
      a list with one NDArray per sample;
    - "index" -> an int64 NDArray of global sample ids;
    - strings and anything else pass through unchanged.
    """
    ctx = ctx if ctx is not None else mx.cpu()
    return converted(batch, lambda arr: _ndarray(arr, ctx))


# --- Gluon: an iterable of dicts of NDArray ----------------------------------------------------

class MXNetLoader(EpochPasses):
    """This rank's dmdask batches, epoch after epoch, as dicts of `mx.nd.NDArray`.

    Guarantees: those of `EpochPasses` with moves_on=True: handing out the last batch of
    an epoch moves the loader to the next epoch, a pass abandoned part-way does not.
    `state_dict()` holds plain values (for pickle or JSON next to `net.save_parameters`).

    client: a `distributed.Client` of a cluster of dmdask workers.
    spec: a `dmdask.Spec`; with `kvstore` (a distributed `mx.kv.KVStore`) at the default
        rank/world size, they are taken from it (see `kvstore_spec`).
    ctx: the `mx.Context` of the NDArrays (default `mx.cpu()`).
    epoch: the first epoch.

    No `gluon.data.DataLoader` is needed: dmdask prefetches on the cluster. One pass at a
    time. With kvstore "dist_sync" give every worker `spec.drop_last=True`.
    """

    def __init__(self, client, spec: dmdask.Spec, *, ctx=None, kvstore=None, epoch: int = 0):
        if not isinstance(spec, dmdask.Spec):
            raise TypeError(f"spec must be a dmdask.Spec, got {type(spec).__name__}")
        super().__init__(client, kvstore_spec(spec, kvstore), epoch)
        self.ctx = ctx if ctx is not None else mx.cpu()

    def __iter__(self):
        for batch in self.start_pass():
            yield to_mxnet(batch, self.ctx)

    def __repr__(self) -> str:
        s = self.spec
        return (f"MXNetLoader(source={s.source!r}, batch_size={s.batch_size}, rank={s.rank}, "
                f"world_size={s.world_size}, epoch={self.epoch}, ctx={self.ctx})")


# --- the Module API: an mx.io.DataIter ----------------------------------------------------------

class DmdaskDataIter(mx.io.DataIter):
    """An `mx.io.DataIter` over this rank's dmdask batches, for `Module.fit` and friends.

    Each `DataBatch` has `data` (NDArrays of the fields in `data_names`), `label` (of
    `label_names`), `index` (the global sample ids, numpy int64) and `pad=0`: dmdask
    never pads with repeated samples, so the last batch of an epoch may be shorter
    (with its own `provide_data`, which `Module` reshapes to), unless `spec.drop_last`.
    `provide_data` / `provide_label` describe full batches: `mx.io.DataDesc(name,
    (batch_size, *sample_shape), dtype)`, read from one batch of the current epoch.

    Epochs: `next()` goes through the current epoch, then raises StopIteration; handing
    out its last batch moves on to the next epoch, so `reset()` after a finished epoch
    (as `Module.fit` does after each) starts the next one. `reset()` part-way through
    starts the current epoch again from its start point (its first batch, or a loaded
    position). `set_epoch`, `len()`, `state_dict()` / `load_state_dict()` and `close()`
    are as in `MXNetLoader` (resume with `Module.fit(..., begin_epoch=state["epoch"])`).

    client, spec, kvstore, epoch: as for `MXNetLoader`.
    data_names, label_names: the fields of the source that are inputs and labels
        (numeric, fixed sample shape).
    ctx: the context of the NDArrays (default `mx.cpu()`; `Module` copies to its own).
    """

    def __init__(self, client, spec: dmdask.Spec, data_names: Sequence[str] = ("data",),
                 label_names: Sequence[str] = ("softmax_label",), *, ctx=None, kvstore=None, epoch: int = 0):
        if isinstance(data_names, str) or isinstance(label_names, str):
            raise TypeError("data_names and label_names are sequences of field names")
        self.loader = MXNetLoader(client, spec, ctx=ctx, kvstore=kvstore, epoch=epoch)
        self.data_names, self.label_names = tuple(data_names), tuple(label_names)
        super().__init__(batch_size=self.loader.spec.batch_size)
        first = self.loader.peek()
        missing = [n for n in self.data_names + self.label_names if n not in first]
        if missing:
            raise ValueError(f"fields {missing} are not among the batch's fields {sorted(first)}")
        self._provide_data = [self._desc(n, first[n], self.batch_size) for n in self.data_names]
        self._provide_label = [self._desc(n, first[n], self.batch_size) for n in self.label_names]
        self._gen = None
        self._done = False

    @staticmethod
    def _desc(name: str, value, rows: int):
        value = np.asarray(value)
        if value.dtype == object or value.dtype.kind not in "biuf":
            raise TypeError(f"field {name!r} holds {value.dtype} samples; a DataIter field must be numeric "
                            "with one sample shape (use MXNetLoader for variable-size samples)")
        return mx.io.DataDesc(name, (rows,) + value.shape[1:], dtype=_mx_dtype(value.dtype))

    @property
    def provide_data(self):
        return self._provide_data

    @property
    def provide_label(self):
        return self._provide_label

    @property
    def spec(self) -> dmdask.Spec:
        return self.loader.spec

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def set_epoch(self, epoch: int) -> None:
        self.reset()
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def reset(self) -> None:
        if self._gen is not None:
            self._gen.close()  # cancels its prefetched batches
        self._gen = None
        self._done = False

    def next(self):
        if self._done:
            raise StopIteration
        if self._gen is None:
            self._gen = self.loader.start_pass()
        try:
            batch = next(self._gen)
        except StopIteration:
            self._gen, self._done = None, True
            raise
        rows = len(batch["index"])
        out = to_mxnet({n: batch[n] for n in self.data_names + self.label_names}, self.loader.ctx)
        provide_data, provide_label = self._provide_data, self._provide_label
        if rows != self.batch_size:  # a short last batch describes its own shape
            provide_data = [self._desc(n, batch[n], rows) for n in self.data_names]
            provide_label = [self._desc(n, batch[n], rows) for n in self.label_names]
        return mx.io.DataBatch(data=[out[n] for n in self.data_names], label=[out[n] for n in self.label_names],
                               pad=0, index=np.asarray(batch["index"], dtype=np.int64),
                               provide_data=provide_data, provide_label=provide_label)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reset()
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.reset()
        self.loader.close()

    def __repr__(self) -> str:
        s = self.spec
        return (f"DmdaskDataIter(source={s.source!r}, batch_size={s.batch_size}, rank={s.rank}, "
                f"world_size={s.world_size}, epoch={self.epoch}, data={self.data_names}, label={self.label_names})")
