"""Checks of what clients send to dmdask's scheduler and worker handlers.

A handler checks its arguments at its entry, before it changes anything: a wrong type, a
value out of range or an unknown key raises `HandlerArgumentError` naming the handler, the
argument and what it takes (the caller's RPC re-raises it). The checks copy nothing.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np

from .errors import HandlerArgumentError
from .source.base import MAX_BLOCKS, MAX_BYTES, MAX_SAMPLES, DatasetInfo

REPORT_SAMPLES = 1 << 40  # the most samples one `dmdask_count_hits` report counts (a day of any epoch's)
REPORT_BYTES = 1 << 56  # and bytes


def refuse(handler: str, name: str, expected: str, value) -> HandlerArgumentError:
    shown = repr(value)
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    return HandlerArgumentError(f"{handler}: {name}={shown} is refused: expected {expected}")


def text(handler: str, name: str, value, optional: bool = False) -> str | None:
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


def count(handler: str, name: str, value, low: int = 0, high: int | None = None) -> int:
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


def mapping(handler: str, name: str, value, known: Iterable[str] | None = None,
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


def dataset_info(handler: str, info, lazy: bool = False) -> DatasetInfo:
    """A `DatasetInfo` whose fields are each of its type and range (at most `MAX_SAMPLES`
    samples in at most `MAX_BLOCKS` blocks), its identity bound to its name
    (`DatasetInfo.bound`); `lazy` (registered with no block loaded, which nobody checks
    against the store): a file's dataset, named `fs-<identity>` (`dmdask.source.files`)."""
    if not isinstance(info, DatasetInfo):
        raise refuse(handler, "info", "a DatasetInfo", info)
    for name in ("name", "identity", "url"):
        text(handler, f"info.{name}", getattr(info, name))
    texts(handler, "info.fields", info.fields)
    count(handler, "info.num_samples", info.num_samples, low=0, high=MAX_SAMPLES)
    count(handler, "info.block_len", info.block_len, low=1, high=MAX_SAMPLES)
    if info.num_blocks > MAX_BLOCKS:
        raise refuse(handler, "info.num_samples", f"at most {MAX_BLOCKS} blocks of info.block_len={info.block_len} "
                     "samples", info.num_samples)
    if info.nbytes is not None:
        count(handler, "info.nbytes", info.nbytes, low=0, high=MAX_BYTES)
    if info.field_types is not None:
        field_types(handler, info)
    if not info.bound:
        raise refuse(handler, "info.identity", f"an identity that starts with the token of info.name={info.name!r} "
                     "(a registry entry is bound to its source: dmdask.source.base.bound_identity)", info.identity)
    if lazy and info.name != "fs-" + info.identity:
        raise refuse(handler, "info.name", f"'fs-{info.identity}': only a file's dataset (transparent mode) is "
                     "registered lazily", info.name)
    return info


def field_types(handler: str, info: DatasetInfo) -> None:
    """`info.field_types`: a (name, dtype string, sample shape) of each of `info.fields`, in their order."""
    expected = "None or a (name, numpy dtype string, sample shape) for each of info.fields, in their order"
    types = info.field_types
    if not isinstance(types, (tuple, list)) or len(types) != len(info.fields):
        raise refuse(handler, "info.field_types", expected, types)
    for field, entry in zip(info.fields, types):
        if not isinstance(entry, (tuple, list)) or len(entry) != 3 or entry[0] != field or \
                not isinstance(entry[1], str) or not isinstance(entry[2], (tuple, list)) or \
                not all(isinstance(n, numbers.Integral) and n >= 0 for n in entry[2]):
            raise refuse(handler, "info.field_types", expected, types)
        try:
            np.dtype(entry[1])
        except TypeError:
            raise refuse(handler, "info.field_types", expected, types) from None


def block_order(handler: str, order, num_blocks: int) -> list | None:
    """None, or every block index 0..num_blocks-1 once (the order they are first needed)."""
    if order is None:
        return None
    arr = np.asarray(order) if isinstance(order, (list, tuple)) else None
    if arr is None or arr.ndim != 1 or len(arr) != num_blocks or (num_blocks and arr.dtype.kind not in "iu") \
            or not np.array_equal(np.sort(arr), np.arange(num_blocks)):
        raise refuse(handler, "order", f"None or a list of the block indices 0..{num_blocks - 1}, each once", order)
    return order
