"""MXNet adapter: `MXNetLoader` (Gluon, dicts of NDArray) and `DmdaskDataIter` (an `mx.io.DataIter`
for the Module API); docs/frameworks.md.

MXNet 1.9.1 uses `np.bool`, which numpy 1.24 removed: this module sets `numpy.bool = bool`
(only when numpy lacks it) before it imports mxnet, so import it before mxnet.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

if "bool" not in np.__dict__:  # the MXNet 1.9.1 shim: np.bool was removed in numpy 1.24
    np.bool = bool
with warnings.catch_warnings():  # MXNet's import-time noise: distutils, numpy financial functions
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx  # noqa: E402

import dmdask  # noqa: E402
from ._fields import converted  # noqa: E402
from ._passes import EpochPasses, described  # noqa: E402
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


def to_mxnet(batch: dict[str, Any], ctx=None) -> dict[str, Any]:
    """One dmdask batch converted by `_fields.converted` to NDArrays on `ctx` (default
    `mx.cpu()`), copying; dtypes widened by `_mx_dtype`, those NDArray lacks stay numpy."""
    ctx = ctx if ctx is not None else mx.cpu()
    return converted(batch, lambda arr: _ndarray(arr, ctx))


class MXNetLoader(EpochPasses):
    """This rank's dmdask batches, epoch after epoch, as dicts of `mx.nd.NDArray`.

    Guarantees: those of `EpochPasses` with moves_on=True; `state_dict()` holds plain values.

    spec: with a distributed `kvstore`, rank and world size from it (`kvstore_spec`).
    ctx: the `mx.Context` of the NDArrays (default `mx.cpu()`).
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
        return described("MXNetLoader", self, ctx=self.ctx)


class DmdaskDataIter(mx.io.DataIter):
    """An `mx.io.DataIter` over this rank's dmdask batches, for `Module.fit` and friends.

    Each `DataBatch` has `data` (the `data_names` fields), `label` (`label_names`), `index`
    (numpy int64) and `pad=0`: a short last batch carries its own `provide_data`.
    `provide_data` / `provide_label` describe full batches, read from one batch.

    `next()` goes through the current epoch, then raises StopIteration; `reset()` after a
    finished epoch starts the next one, part-way it starts the current one again from its
    start point. The other arguments and methods are those of `MXNetLoader`. The named
    fields must be numeric with one sample shape (TypeError otherwise).
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
        return described("DmdaskDataIter", self, data=self.data_names, label=self.label_names)
