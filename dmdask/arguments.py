"""Checks of what clients send to dmdask's scheduler and worker handlers.

A handler checks its arguments at its entry, before it changes anything, and refuses
a wrong type, a value out of range or an unknown key with `HandlerArgumentError`
naming the handler, the argument and what it takes, which the caller's RPC re-raises.
So nothing a client sends can corrupt the registry or the counters other clients read.
The checks cost O(arguments): nothing is copied.
"""
from __future__ import annotations

import numbers
from typing import Iterable, Optional

import numpy as np

from .errors import HandlerArgumentError
from .source.base import DatasetInfo


def refuse(handler: str, name: str, expected: str, value) -> HandlerArgumentError:
    shown = repr(value)
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    return HandlerArgumentError(f"{handler}: {name}={shown} is refused: expected {expected}")


def text(handler: str, name: str, value, optional: bool = False) -> Optional[str]:
    """A non-empty string (or None when `optional`)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise refuse(handler, name, "a non-empty string" + (" or None" if optional else ""), value)
    return value


def texts(handler: str, name: str, value) -> list:
    """A list (or tuple) of non-empty strings."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise refuse(handler, name, "a list of non-empty strings", value)
    return list(value)


def tuples(handler: str, name: str, value, width: int, leading_texts: int = 0) -> list:
    """A list (or tuple) of lists (or tuples) of `width` items each, the first
    `leading_texts` of them non-empty strings."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, (list, tuple)) and len(v) == width
            and all(isinstance(t, str) and t for t in v[:leading_texts]) for v in value):
        raise refuse(handler, name, f"a list of lists of {width} items"
                     + (f", the first {leading_texts} non-empty strings" if leading_texts else ""), value)
    return list(value)


def count(handler: str, name: str, value, low: int = 0, high: Optional[int] = None) -> int:
    """An integer in low..high (bools refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < low \
            or (high is not None and value > high):
        raise refuse(handler, name, f"an integer >= {low}" + ("" if high is None else f" and <= {high}"), value)
    return int(value)


def number(handler: str, name: str, value, low: float, high: float) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not low <= value <= high:
        raise refuse(handler, name, f"a number in {low}..{high}", value)
    return float(value)


def flag(handler: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise refuse(handler, name, "True or False", value)
    return bool(value)


def mapping(handler: str, name: str, value, known: Optional[Iterable[str]] = None,
            required: Iterable[str] = ()) -> dict:
    """A dict with string keys; with `known`, no other keys, and every `required` one."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise refuse(handler, name, "a dict with string keys", value)
    if known is not None:
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise refuse(handler, name, f"a dict of the keys {sorted(known)} only (unknown: {unknown})", value)
    missing = [k for k in required if k not in value]
    if missing:
        raise refuse(handler, name, f"a dict with the keys {list(required)} (missing: {missing})", value)
    return value


def indices(handler: str, name: str, value, length: int) -> np.ndarray:
    """A 1-d array (or list) of integers in 0..length-1."""
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= length)):
        raise refuse(handler, name, f"a 1-d array of integers in 0..{length - 1}", value)
    return arr


def dataset_info(handler: str, info) -> DatasetInfo:
    """A `DatasetInfo` whose fields are each of its type and range."""
    if not isinstance(info, DatasetInfo):
        raise refuse(handler, "info", "a DatasetInfo", info)
    for name in ("name", "identity", "url"):
        text(handler, f"info.{name}", getattr(info, name))
    texts(handler, "info.fields", info.fields)
    count(handler, "info.num_samples", info.num_samples, low=0)
    count(handler, "info.block_len", info.block_len, low=1)
    if info.nbytes is not None:
        count(handler, "info.nbytes", info.nbytes, low=0)
    return info


def block_order(handler: str, order, num_blocks: int) -> Optional[list]:
    """None, or every block index 0..num_blocks-1 once (the order they are first needed)."""
    if order is None:
        return None
    arr = np.asarray(order) if isinstance(order, (list, tuple)) else None
    if arr is None or arr.ndim != 1 or len(arr) != num_blocks or (num_blocks and arr.dtype.kind not in "iu") \
            or not np.array_equal(np.sort(arr), np.arange(num_blocks)):
        raise refuse(handler, "order", f"None or a list of the block indices 0..{num_blocks - 1}, each once", order)
    return order
