"""The walk over a batch's fields that the PyTorch, JAX and MXNet adapters share (imports no framework)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["converted"]


def converted(batch: dict[str, Any], array: Callable, sample: Callable | None = None,
              index: bool = True) -> dict[str, Any]:
    """`batch` (a dict of numpy arrays) with each field converted:

    - "index" as int64 sample ids, converted by `array` (left numpy with index=False);
    - a numeric array by `array`;
    - an object array (variable-size samples) as a list, each sample that is a
      non-object array converted by `sample` (default: `array`), other elements kept;
    - strings, structured arrays and non-arrays as they are.
    """
    sample = sample if sample is not None else array
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if name == "index":
            ids = np.asarray(value).astype(np.int64, copy=False)
            out[name] = array(ids) if index else ids
        elif not isinstance(value, np.ndarray) or value.dtype.kind in "USV":
            out[name] = value
        elif value.dtype == object:
            out[name] = [sample(v) if isinstance(v, np.ndarray) and v.dtype != object else v for v in value]
        else:
            out[name] = array(value)
    return out
