"""Datasets on the shared store: their description and how a block is read.

`locate(spec)` tells what a spec points at with a request or two (for Zarr, its
metadata); `SourceRef.open()` reads what creating the blocks needs (for a folder, its
listing), which only the process that creates a dataset's blocks does.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import fsspec

from ..errors import SourceNotFoundError, SpecError
from .base import BlockReader, DatasetInfo, Source, block_key, is_block_key, parse_block_key
from .folder import folder_fields, folder_name, open_folder
from .zarr import open_zarr

__all__ = ["BlockReader", "DatasetInfo", "Source", "SourceRef", "block_key", "is_block_key", "locate",
           "parse_block_key"]


@dataclasses.dataclass(frozen=True)
class SourceRef:
    """A located dataset: its registry `name`, and `open()` to read what creating its blocks needs."""

    name: str
    open: Callable[[], Source]


def locate(spec) -> SourceRef:
    """What `spec.source` is, without listing it.

    Raises `SourceNotFoundError` if nothing is there, `SourceError` if the layout is
    unusable, `SpecError` if the spec does not fit the source.
    """
    url = spec.source.rstrip("/")
    options = dict(spec.storage_options or {})
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        raise SpecError("source", f"a URL fsspec can open ({exc})", spec.source) from None
    try:
        exists = fs.exists(path)
    except Exception as exc:  # network errors, permissions
        raise SourceNotFoundError(f"cannot reach dataset {url}: {exc}") from exc
    if not exists:
        raise SourceNotFoundError(
            f"dataset {url} does not exist; pass a Zarr v3 group or array, or a folder "
            "of class subfolders, as Spec(source=...)"
        )
    if fs.exists(path.rstrip("/") + "/zarr.json"):
        source = open_zarr(url, options, spec)
        return SourceRef(source.info.name, lambda: source)
    folder_fields(spec)  # a clear error now, before any listing
    return SourceRef(folder_name(url, options, spec), lambda: open_folder(fs, path, url, options, spec))
