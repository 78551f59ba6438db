"""The walk over a batch's fields that the PyTorch, JAX and MXNet adapters share: `converted`.

This module imports numpy and no framework.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import numpy as np

__all__ = ["converted"]


def converted(batch: Dict[str, Any], array: Callable, sample: Optional[Callable] = None,
              index: bool = True) -> Dict[str, Any]:
    """`batch` (a dict of numpy arrays) with each field converted:

    - "index" as int64 sample ids, converted by `array` (left numpy with index=False);
    - a numeric array by `array`;
    - an object array (variable-size samples) as a list, each sample that is a
      non-object array converted by `sample` (default: `array`), other elements kept;
    - strings, structured arrays and non-arrays as they are.
    """
    sample = sample if sample is not None else array
    out: Dict[str, Any] = {}
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
