"""Datasets on the shared store: their description and how a block is read.

`dataset_name(spec)` names the dataset a spec reads, with no I/O: the cluster's
registry knows a dataset by it, so a rank that joins a dataset already created reads
nothing from the shared store to plan its epoch. `open_source(spec)` reads what creating
the blocks needs (Zarr metadata, a folder's listing); only the process that creates a
dataset's blocks calls it, once per cluster. The cluster keeps a dataset as it was
when first opened: after changing it in place, `dmdask.release` it.
"""
from __future__ import annotations

import fsspec
from dask.base import tokenize

from ..errors import SourceNotFoundError, SpecError
from .base import BlockReader, DatasetInfo, Source, block_key, is_block_key, options_json, parse_block_key
from .folder import folder_fields, open_folder
from .zarr import open_zarr

__all__ = ["BlockReader", "DatasetInfo", "Source", "block_key", "dataset_name", "is_block_key", "open_source",
           "parse_block_key"]


def dataset_name(spec) -> str:
    """The registry name of the dataset `spec` reads: its URL, storage options, fields
    and block size (no I/O)."""
    keys = None if spec.keys is None else sorted(spec.keys)
    return f"ds-{tokenize(spec.source.rstrip('/'), options_json(spec.storage_options), keys, spec.block_size)[:16]}"


def open_source(spec) -> Source:
    """Open `spec.source`: a Zarr v3 group or array, or a folder of class subfolders.

    Raises `SourceNotFoundError` if nothing is there, `SourceError` if the layout is
    unusable or holds no samples, `SpecError` if the spec does not fit the source.
    """
    url = spec.source.rstrip("/")
    options = dict(spec.storage_options or {})
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        raise SpecError("source", f"a URL fsspec can open ({exc})", spec.source) from None
    exists = _exists(fs, path, url)
    if not exists:
        raise SourceNotFoundError(
            f"dataset {url} does not exist; pass a Zarr v3 group or array, or a folder "
            "of class subfolders, as Spec(source=...)"
        )
    name = dataset_name(spec)
    if fs.exists(path.rstrip("/") + "/zarr.json"):
        source = open_zarr(url, options, spec, name)
        missing = [k for k in spec.keys or () if k not in source.info.fields]
        if missing:
            raise SpecError("keys", f"names among the source's arrays {list(source.info.fields)}", list(spec.keys))
        return source
    folder_fields(spec)  # a clear error now, before any listing
    return open_folder(fs, path, url, options, spec, name)


def _exists(fs, path: str, url: str) -> bool:
    """Whether `path` exists, asked with `info` (over HTTP a HEAD request, where
    `exists` would start a GET of the whole file)."""
    try:
        fs.info(path)
        return True
    except FileNotFoundError:
        return False
    except Exception as exc:  # network errors, permissions
        raise SourceNotFoundError(f"cannot reach dataset {url}: {exc}") from exc
