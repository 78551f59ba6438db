"""Adapters that hand dmdask batches to deep-learning frameworks.

Each adapter lives in its own module and imports only its own framework, so
importing this package imports none:

- `dmdask.integrations.torch`: `TorchLoader`, a DataLoader-like iterable of dicts of
  `torch.Tensor` with `set_epoch`, `len()` and `state_dict()`/`load_state_dict()`.
- `dmdask.integrations.tensorflow`: `TFLoader`, a `tf.data.Dataset` of dicts of tensors for
  `model.fit` and `tf.distribute` strategies, checkpointed with `tf.train.Checkpoint`.
- `dmdask.integrations.mxnet`: `MXNetLoader`, an iterable of dicts of `mx.nd.NDArray` for
  Gluon, and `DmdaskDataIter`, an `mx.io.DataIter` for the Module API.
- `dmdask.integrations.jax`: `JaxLoader`, an iterable of dicts of `jax.Array`, optionally
  sharded over devices.

The TensorFlow, MXNet and JAX loaders share their epoch and resume bookkeeping
(`dmdask.integrations._passes`, which imports no framework): handing out an epoch's last
batch moves them on to the next epoch.
"""
