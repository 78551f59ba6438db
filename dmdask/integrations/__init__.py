"""Adapters that hand dmdask batches to deep-learning frameworks (docs/frameworks.md): `torch`,
`tensorflow`, `mxnet` and `jax`, one module each, each importing only its own framework, so
importing this package imports none. What they share imports no framework: `_passes` (epochs
and resume), `_rank` (the rank rule), `_fields` (the walk over a batch's fields).
"""
