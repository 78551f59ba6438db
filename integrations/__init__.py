"""Adapters that hand dmdask batches to deep-learning frameworks.

Each adapter lives in its own module and imports only its own framework, so
importing this package imports none:

- `integrations.torch`: `TorchLoader`, a DataLoader-like iterable of dicts of
  `torch.Tensor` with `set_epoch`, `len()` and `state_dict()`/`load_state_dict()`.
"""
