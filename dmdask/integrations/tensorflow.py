"""TensorFlow adapter: `TFLoader`, dmdask batches as a `tf.data.Dataset` that `model.fit` takes.

    loader = TFLoader(client, dmdask.Spec(source="train.zarr", batch_size=256))
    ds = loader.dataset().map(lambda b: (b["x"], b["y"]))   # elements: dict[str, tf.Tensor]
    model.fit(ds, epochs=5)                                  # fit epoch k iterates dmdask epoch k
    tf.train.Checkpoint(model=model, loader=loader).save("ckpt/run")   # with the loader's position

Each pass over the dataset (each `fit` epoch) iterates the loader's current dmdask epoch.
dmdask prefetches on the cluster, so the dataset needs no `.prefetch()`, no
`num_parallel_calls` and no `.shard()` (each rank already gets only its share).
This module imports TensorFlow and no other framework.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf

import dmdask
from ._passes import EpochPasses
from ._rank import spec_for_rank

__all__ = ["TFLoader", "to_tensorflow", "strategy_spec", "rank_of_strategy", "signature_of"]

_RAGGED_MODES = ("ragged", "bytes")


# --- rank and world size -------------------------------------------------------------------

def rank_of_strategy(strategy=None, input_context=None) -> tuple:
    """(rank, world_size) of this input pipeline: the process's place among the workers.

    - `input_context` (a `tf.distribute.InputContext`, as handed to the function of
      `strategy.distribute_datasets_from_function`): its `input_pipeline_id` and
      `num_input_pipelines`.
    - a strategy with a multi-worker `cluster_resolver` (`MultiWorkerMirroredStrategy`,
      `TPUStrategy` over several hosts): the chief is rank 0 and worker i is rank
      i + (number of chiefs), among chief + worker tasks, as TensorFlow numbers its
      input pipelines. An "evaluator" task reads the whole dataset: (0, 1).
    - a single-worker strategy (default, `MirroredStrategy`, `OneDeviceStrategy`): (0, 1);
      its local replicas split each batch, so `spec.batch_size` is the global batch.
    `ParameterServerStrategy` raises ValueError: there the coordinator reads the data;
    give the rank and world size in the spec instead.
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


def to_tensorflow(batch: Dict[str, Any], ragged: str = "ragged") -> Dict[str, Any]:
    """Convert one dmdask batch (dict of numpy arrays) to a dict of TensorFlow values.

    - numeric arrays -> `tf.Tensor` of the same dtype and shape (a copy);
    - object arrays of variable-size numeric samples (e.g. the uint8 bytes of a file
      folder) -> `tf.RaggedTensor` (rows = samples, every inner dimension ragged), or
      with ragged="bytes" a `tf.string` vector of each sample's raw bytes (for
      `tf.io.decode_image` and friends);
    - str/bytes arrays -> `tf.string`; "index" -> int64 global sample ids.
    """
    if ragged not in _RAGGED_MODES:
        raise ValueError(f"ragged must be one of {_RAGGED_MODES}, got {ragged!r}")
    return {name: _field(name, value, ragged) for name, value in batch.items()}


def _unbatched(spec):
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec(shape=[None] * spec.shape.rank, dtype=spec.dtype,
                                   ragged_rank=spec.ragged_rank, row_splits_dtype=spec.row_splits_dtype)
    return tf.TensorSpec(shape=[None] + spec.shape.as_list()[1:], dtype=spec.dtype)


def signature_of(batch: Dict[str, Any]) -> Dict[str, Any]:
    """The `output_signature` of batches like `batch` (converted or numpy): the batch
    dimension unknown (the last batch may be short), the other dimensions as in `batch`."""
    converted = {k: v if isinstance(v, (tf.Tensor, tf.RaggedTensor)) else _field(k, v, "ragged")
                 for k, v in batch.items()}
    return {k: _unbatched(tf.type_spec_from_value(v)) for k, v in converted.items()}


# --- the loader -----------------------------------------------------------------------------

class TFLoader(tf.train.experimental.PythonState, EpochPasses):
    """This rank's dmdask batches, epoch after epoch, as a `tf.data.Dataset` of dicts.

    Guarantees: those of `EpochPasses` with moves_on=True, a pass being one over
    `dataset()`: handing out the last batch of an epoch moves the loader to the next
    epoch, so `model.fit(ds, epochs=E)` iterates epochs 0..E-1 (from a restored state:
    pass `initial_epoch=loader.epoch`); a pass abandoned part-way (`take`, `break`, Keras
    peeking at one batch to build the model) does not. The loader is also a
    `tf.train.Checkpoint` dependency: its state is saved and restored with it.

    client: a `distributed.Client` of a cluster of dmdask workers.
    spec: a `dmdask.Spec`; rank and world size may come from `strategy` or
        `input_context` (see `strategy_spec`), resolved once, here.
    strategy: a `tf.distribute.Strategy` (default: the one in scope, if any).
    input_context: a `tf.distribute.InputContext`, inside `distribute_datasets_from_function`.
    epoch: the first epoch.
    ragged: how variable-size samples arrive: "ragged" (`tf.RaggedTensor`) or "bytes"
        (`tf.string`).
    output_signature: the dataset's element signature; by default read from one batch
        of the current epoch (fetched once, by a separate iterator that moves no
        position). Give it when a transform makes inner shapes vary between batches.

    Positions count batches taken from the dataset, so a mid-epoch checkpoint is exact in
    a plain loop over it (a `.prefetch()` or a parallel `.map()` reads ahead); under
    `model.fit` checkpoint at epoch ends. One pass at a time. Under a multi-worker
    strategy use `distribute()` and give every worker `spec.drop_last=True`.
    """

    def __init__(self, client, spec: dmdask.Spec, *, strategy=None, input_context=None, epoch: int = 0,
                 ragged: str = "ragged", output_signature: Optional[Dict[str, Any]] = None):
        if not isinstance(spec, dmdask.Spec):
            raise TypeError(f"spec must be a dmdask.Spec, got {type(spec).__name__}")
        if ragged not in _RAGGED_MODES:
            raise ValueError(f"ragged must be one of {_RAGGED_MODES}, got {ragged!r}")
        EpochPasses.__init__(self, client, strategy_spec(spec, strategy, input_context), epoch)
        self.ragged = ragged
        self._signature = dict(output_signature) if output_signature is not None else None

    @property
    def output_signature(self) -> Dict[str, Any]:
        """dict of `tf.TensorSpec`/`tf.RaggedTensorSpec`, batch dimension None."""
        if self._signature is None:
            self._signature = signature_of(to_tensorflow(self.peek(), self.ragged))
        return self._signature

    def dataset(self, repeat: bool = False) -> tf.data.Dataset:
        """A `tf.data.Dataset` of this rank's batches (dicts of tensors incl. "index").

        Each pass iterates the loader's current epoch (see the class). repeat=True: one
        endless pass, epoch after epoch, for `model.fit(..., steps_per_epoch=len(loader))`
        or loops that count steps.
        """
        ds = tf.data.Dataset.from_generator(lambda: self._generate(repeat), output_signature=self.output_signature)
        options = tf.data.Options()
        # each rank already reads only its share: tf.distribute must not shard it again
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        # dmdask prefetches already; without tf.data's own read-ahead (injected prefetch,
        # sequential maps made parallel) the positions count the batches taken from the
        # pipeline. An explicit .prefetch() or parallel map still reads ahead.
        options.experimental_optimization.inject_prefetch = False
        options.experimental_optimization.map_parallelization = False
        return ds.with_options(options)

    def distribute(self, strategy=None, map_fn=None, repeat: bool = False):
        """`dataset(repeat).map(map_fn)` as this worker's input pipeline of `strategy`
        (default: the strategy in scope), through `strategy.distribute_datasets_from_function`.

        Use it for multi-worker strategies: `strategy.experimental_distribute_dataset`
        (what `model.fit` applies to a plain dataset) takes each batch as the global batch
        and splits it across the replicas of all workers. Here each batch goes whole to
        one local replica: `spec.batch_size` is the per-replica batch. The input context
        must agree with the loader's rank and world size (ValueError if not).
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
        s = self.spec
        return (f"TFLoader(source={s.source!r}, batch_size={s.batch_size}, rank={s.rank}, "
                f"world_size={s.world_size}, epoch={self.epoch}, ragged={self.ragged!r})")
