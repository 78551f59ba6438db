"""Adapters that hand dmdask batches to deep-learning frameworks.

Each adapter lives in its own module and imports only its own framework, so
importing this package imports none:

- `dmdask.integrations.torch`: `TorchLoader`, a DataLoader-like iterable of dicts of `torch.Tensor`.
- `dmdask.integrations.tensorflow`: `TFLoader`, a `tf.data.Dataset` of dicts of tensors for
  `model.fit` and `tf.distribute` strategies, checkpointed with `tf.train.Checkpoint`.
- `dmdask.integrations.mxnet`: `MXNetLoader`, an iterable of dicts of `mx.nd.NDArray` for
  Gluon, and `DmdaskDataIter`, an `mx.io.DataIter` for the Module API.
- `dmdask.integrations.jax`: `JaxLoader`, an iterable of dicts of `jax.Array`, optionally sharded.

What they share imports no framework: `_passes` (the epoch and resume bookkeeping, with
one epoch-advance policy per loader), `_rank` (the rank rule), `_fields` (the walk over
a batch's fields).
"""
