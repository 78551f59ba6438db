"""Datasets on the shared store: their description and how a block is read.

`dataset_name(spec)` does no I/O, so a rank that joins a dataset already created reads
nothing from the store to plan its epoch. `open_source(spec)` reads what creating the
blocks needs; only the process that creates a dataset's blocks calls it, once per
cluster. The cluster keeps a dataset as it was first opened: after changing it in
place, `dmdask.release` it. Other packages add formats (`registry.Format`).
"""
from __future__ import annotations

import logging
import time

import dask.config
from dask.base import tokenize

from ..errors import SourceNotFoundError, SpecError, redact
from .base import (FIRST_RETRY_WAIT, LONGEST_RETRY_WAIT, MAX_BLOCKS, BlockReader, DatasetInfo, Source, block_key,
                   is_block_key, is_transient, options_json, parse_block_key)
from .registry import GROUP, LAYOUTS, Format, Place, find, formats, is_tokens
from .urls import LOCAL_PROTOCOLS, normalize

logger = logging.getLogger(__name__)

__all__ = ["BlockReader", "DatasetInfo", "Format", "GROUP", "Place", "Source", "block_key", "dataset_name", "formats",
           "is_block_key", "open_source", "parse_block_key"]


def dataset_name(spec) -> str:
    """The registry name of the dataset `spec` reads, from its URL (`urls.normalize` for local
    paths; a `dmdask.Tokens`'s with its dtype), storage options, fields (and the window's `dim`,
    which picks them) and block size."""
    keys = None if spec.keys is None else sorted(spec.keys)
    if isinstance(spec.source, tuple):
        source = tuple(map(_named, spec.source))
    elif is_tokens(spec.source):
        source = ("tokens", _named(spec.source.path), spec.source.dtype)
    else:
        source = _named(spec.source)
    dim = () if spec.window is None or spec.window.dim is None else (spec.window.dim,)  # it picks the fields
    return f"ds-{tokenize(source, options_json(spec.storage_options), keys, spec.block_size, *dim)[:16]}"


def _named(url: str) -> str:
    if "::" not in url and ("://" not in url or url.startswith(LOCAL_PROTOCOLS)):
        return normalize(url)
    return url.rstrip("/")


def open_source(spec) -> Source:
    """Open `spec.source` with the first format that claims it (`registry`). Raises
    `SourceNotFoundError` if nothing is there, `SourceError` if the layout is unusable
    or holds no samples, `SpecError` if the spec does not fit the source (more than
    `MAX_BLOCKS` blocks among others). A transient store error (a 503, a reset connection:
    `is_transient`) opens it again with backoff for up to `dmdask.store.retry-seconds`,
    then is a `SourceNotFoundError` naming the tries."""
    budget = float(dask.config.get("dmdask.store.retry-seconds"))
    started, wait, tries = time.monotonic(), FIRST_RETRY_WAIT, 1
    while True:
        try:
            return _open(spec)
        except Exception as exc:  # noqa: BLE001 - transient ones retried, any other raised as it is
            spent = time.monotonic() - started
            if not is_transient(exc):
                raise
            if spent + wait > budget:
                raise SourceNotFoundError(f"cannot open dataset {spec.source} (after {tries} tries in {spent:.1f} s): "
                                          f"{type(exc).__name__}: {exc}") from None
            logger.warning("transient error opening %s, try %d, next in %.2f s: %s: %s", redact(str(spec.source)),
                           tries, wait, type(exc).__name__, redact(str(exc)))
            time.sleep(wait)
            wait, tries = min(2 * wait, LONGEST_RETRY_WAIT), tries + 1


def _open(spec) -> Source:
    place = Place(spec, dataset_name(spec))
    found = find(place)
    if found is None:
        raise SourceNotFoundError(f"dataset {place.url} does not exist; pass {LAYOUTS} as Spec(source=...)")
    source = found.open(place)
    if spec.window is not None and spec.window.dim is not None and found.name != "zarr":
        raise SpecError("window", f"a Window without dim= for {place.url or place.label('files')} (dim= picks the "
                        "arrays of a Zarr group by their dimension names; this source is not Zarr)", spec.window)
    info = source.info
    if info.num_blocks > MAX_BLOCKS:
        raise SpecError("block_size", f"at least {-(-info.num_samples // MAX_BLOCKS)} samples, so that the "
                        f"{info.num_samples} samples of {place.url or place.label('files')} make at most "
                        f"{MAX_BLOCKS} blocks", spec.block_size)
    return source
