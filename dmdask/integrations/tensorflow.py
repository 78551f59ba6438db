"""TensorFlow adapter: `TFLoader`, dmdask batches as a `tf.data.Dataset` that `model.fit` takes
(docs/frameworks.md). This module imports TensorFlow and no other framework.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import tensorflow as tf

import dmdask
from ._passes import EpochPasses, described
from ._rank import spec_for_rank

__all__ = ["TFLoader", "to_tensorflow", "strategy_spec", "rank_of_strategy", "signature_of"]

_RAGGED_MODES = ("ragged", "bytes")


# --- rank and world size -------------------------------------------------------------------

def rank_of_strategy(strategy=None, input_context=None) -> tuple:
    """(rank, world_size) of this input pipeline: from `input_context` if given; else from a
    multi-worker `cluster_resolver`: chief rank 0, worker i rank i + (number of chiefs), as
    TensorFlow numbers its input pipelines; (0, 1) for an "evaluator" task and single-worker
    strategies. `ParameterServerStrategy` and other task types raise ValueError.
    """
    if input_context is not None:
        return int(input_context.input_pipeline_id), int(input_context.num_input_pipelines)
    if strategy is None:
        return 0, 1
    if "ParameterServer" in type(strategy).__name__:
        raise ValueError("ParameterServerStrategy has no per-worker input pipeline to shard; pass rank "
                         "and world_size in the dmdask.Spec")
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 0, 1
    cluster = resolver.cluster_spec().as_dict()
    chiefs = len(cluster.get("chief", []))
    workers = chiefs + len(cluster.get("worker", []))
    task_type, task_id = resolver.task_type, resolver.task_id
    if workers <= 1 or task_type in (None, "evaluator"):
        return 0, 1
    if task_type == "chief":
        return 0, workers
    if task_type == "worker":
        return int(task_id or 0) + chiefs, workers
    raise ValueError(f"task type {task_type!r} reads no training data; pass rank and world_size in the dmdask.Spec")


def strategy_spec(spec: dmdask.Spec, strategy=None, input_context=None) -> dmdask.Spec:
    """`spec` with rank and world size from `input_context` or `strategy` (default: the one
    in scope), as `rank_of_strategy` finds them, by `_rank.spec_for_rank`; one input
    pipeline: `spec` unchanged."""
    if strategy is None and input_context is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    rank, world_size = rank_of_strategy(strategy, input_context)
    if world_size == 1:
        return spec
    return spec_for_rank(spec, rank, world_size, "tf.distribute")


# --- conversion -----------------------------------------------------------------------------

def _ragged(values: list):
    """An object array's elements (numeric arrays of one ndim) as one RaggedTensor whose
    every dimension after the first is ragged."""
    arrays = [np.asarray(v) for v in values]
    ndim = arrays[0].ndim
    if any(a.ndim != ndim for a in arrays) or ndim == 0:
        raise TypeError("variable-size samples must be arrays of one number of dimensions")
    dtype = np.result_type(*arrays)
    flat = np.concatenate([a.reshape(-1).astype(dtype, copy=False) for a in arrays])
    nested = []
    for level in range(ndim):
        nested.append(np.concatenate([np.full(int(np.prod(a.shape[:level], dtype=np.int64)), a.shape[level],
                                              dtype=np.int64) for a in arrays]))
    return tf.RaggedTensor.from_nested_row_lengths(flat, nested, validate=False)


def _field(name: str, value, ragged: str):
    if name == "index":
        return tf.constant(np.asarray(value).astype(np.int64, copy=False))
    if not isinstance(value, np.ndarray):
        value = np.asarray(value)
    if value.dtype.kind in "US":
        return tf.constant(value.astype(object) if value.dtype.kind == "U" else value, dtype=tf.string)
    if value.dtype != object:
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        return tf.constant(value)
    items = list(value)
    if all(isinstance(v, (bytes, str)) for v in items):
        return tf.constant(items, dtype=tf.string)
    if not all(isinstance(v, np.ndarray) and v.dtype.kind in "biuf" for v in items):
        raise TypeError(f"field {name!r}: an object array of {type(items[0]).__name__}; TFLoader takes "
                        "numeric arrays, bytes or str as samples")
    if ragged == "bytes":
        return tf.constant([np.ascontiguousarray(v).tobytes() for v in items], dtype=tf.string)
    return _ragged(items)


def to_tensorflow(batch: dict[str, Any], ragged: str = "ragged") -> dict[str, Any]:
    """One dmdask batch as a dict of TensorFlow values (copies): numeric arrays as `tf.Tensor`;
    variable-size numeric samples as a `tf.RaggedTensor` (every inner dimension ragged) or,
    with ragged="bytes", a `tf.string` of each sample's bytes; str/bytes as `tf.string`;
    "index" as int64. ValueError for another `ragged`, TypeError for other object samples.
    """
    if ragged not in _RAGGED_MODES:
        raise ValueError(f"ragged must be one of {_RAGGED_MODES}, got {ragged!r}")
    return {name: _field(name, value, ragged) for name, value in batch.items()}


def _unbatched(spec):
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec(shape=[None] * spec.shape.rank, dtype=spec.dtype,
                                   ragged_rank=spec.ragged_rank, row_splits_dtype=spec.row_splits_dtype)
    return tf.TensorSpec(shape=[None] + spec.shape.as_list()[1:], dtype=spec.dtype)


def signature_of(batch: dict[str, Any]) -> dict[str, Any]:
    """The `output_signature` of batches like `batch` (converted or numpy): the batch
    dimension unknown (the last batch may be short), the other dimensions as in `batch`."""
    converted = {k: v if isinstance(v, (tf.Tensor, tf.RaggedTensor)) else _field(k, v, "ragged")
                 for k, v in batch.items()}
    return {k: _unbatched(tf.type_spec_from_value(v)) for k, v in converted.items()}


class TFLoader(tf.train.experimental.PythonState, EpochPasses):
    """This rank's dmdask batches, epoch after epoch, as a `tf.data.Dataset` of dicts.

    Guarantees: those of `EpochPasses` with moves_on=True, a pass being one over
    `dataset()`, so `model.fit(ds, epochs=E)` iterates epochs 0..E-1. The loader is a
    `tf.train.Checkpoint` dependency: its state is saved and restored with it.

    spec: rank and world size may come from `strategy` (default: the one in scope) or
        `input_context` (see `strategy_spec`), resolved once, here.
    ragged: variable-size samples as "ragged" (`tf.RaggedTensor`) or "bytes" (`tf.string`).
    output_signature: by default read from one batch of the current epoch (by `peek`).
        Give it when a transform makes inner shapes vary between batches.
    """

    def __init__(self, client, spec: dmdask.Spec, *, strategy=None, input_context=None, epoch: int = 0,
                 ragged: str = "ragged", output_signature: dict[str, Any] | None = None):
        if not isinstance(spec, dmdask.Spec):
            raise TypeError(f"spec must be a dmdask.Spec, got {type(spec).__name__}")
        if ragged not in _RAGGED_MODES:
            raise ValueError(f"ragged must be one of {_RAGGED_MODES}, got {ragged!r}")
        EpochPasses.__init__(self, client, strategy_spec(spec, strategy, input_context), epoch)
        self.ragged = ragged
        self._signature = dict(output_signature) if output_signature is not None else None

    @property
    def output_signature(self) -> dict[str, Any]:
        """dict of `tf.TensorSpec`/`tf.RaggedTensorSpec`, batch dimension None."""
        if self._signature is None:
            self._signature = signature_of(to_tensorflow(self.peek(), self.ragged))
        return self._signature

    def dataset(self, repeat: bool = False) -> tf.data.Dataset:
        """A `tf.data.Dataset` of this rank's batches, each pass over the loader's current
        epoch; repeat=True: one endless pass, epoch after epoch."""
        ds = tf.data.Dataset.from_generator(lambda: self._generate(repeat), output_signature=self.output_signature)
        options = tf.data.Options()
        # each rank already reads only its share: tf.distribute must not shard it again
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        # no tf.data read-ahead of its own, so that positions count the batches taken (an
        # explicit .prefetch() or parallel .map() still reads ahead)
        options.experimental_optimization.inject_prefetch = False
        options.experimental_optimization.map_parallelization = False
        return ds.with_options(options)

    def distribute(self, strategy=None, map_fn=None, repeat: bool = False):
        """`dataset(repeat).map(map_fn)` through `strategy.distribute_datasets_from_function`
        (default: the strategy in scope): each batch goes whole to one local replica. The
        input context must agree with the loader's rank and world size (ValueError if not).
        """
        strategy = strategy if strategy is not None else tf.distribute.get_strategy()

        def dataset_fn(input_context):
            got = (input_context.input_pipeline_id, input_context.num_input_pipelines)
            if got != (self.spec.rank, self.spec.world_size):
                raise ValueError(f"input pipeline {got[0]} of {got[1]} but the loader is rank "
                                 f"{self.spec.rank} of {self.spec.world_size}; create it under the strategy")
            ds = self.dataset(repeat)
            return ds.map(map_fn) if map_fn is not None else ds

        return strategy.distribute_datasets_from_function(dataset_fn)

    def _generate(self, repeat: bool):
        for batch in self.start_pass(repeat):
            yield to_tensorflow(batch, self.ragged)

    # tf.train.experimental.PythonState: the state as JSON inside a tf.train.Checkpoint
    def serialize(self) -> str:
        return json.dumps(self.state_dict(), sort_keys=True)

    def deserialize(self, string_value) -> None:
        if isinstance(string_value, bytes):
            string_value = string_value.decode()
        self.load_state_dict(json.loads(string_value))

    def __repr__(self) -> str:
        return described("TFLoader", self, ragged=repr(self.ragged))
