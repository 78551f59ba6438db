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

What the adapters share lives in modules that import no framework:
`dmdask.integrations._passes` holds the epoch and resume bookkeeping of all four loaders,
with one epoch-advance policy per loader (the TensorFlow, MXNet and JAX loaders move on
to the next epoch when they hand out an epoch's last batch; `TorchLoader` waits for
`set_epoch`); `dmdask.integrations._rank` holds the rank rule (a spec at the defaults
rank=0, world_size=1 takes the rank and world size the framework reports; explicit
values must agree).
"""
