"""Datasets on the shared store: their description and how a block is read.

`dataset_name(spec)` names the dataset a spec reads, with no I/O: the cluster's
registry knows a dataset by it, so a rank that joins a dataset already created reads
nothing from the shared store to plan its epoch. `open_source(spec)` reads what creating
the blocks needs (Zarr metadata, a folder's listing, tar headers); only the process
that creates a dataset's blocks calls it, once per cluster. The cluster keeps a dataset as it was
when first opened: after changing it in place, `dmdask.release` it.
"""
from __future__ import annotations

import fsspec
from dask.base import tokenize

from ..errors import SourceError, SourceNotFoundError, SpecError
from .base import BlockReader, DatasetInfo, Source, block_key, is_block_key, options_json, parse_block_key
from .folder import folder_fields, open_folder
from .webdataset import open_webdataset, shard_paths, shard_urls, shards_label, tar_files
from .zarr import open_zarr

__all__ = ["BlockReader", "DatasetInfo", "Source", "block_key", "dataset_name", "is_block_key", "open_source",
           "parse_block_key"]


def dataset_name(spec) -> str:
    """The registry name of the dataset `spec` reads: its URL (or shard URLs), storage
    options, fields and block size (no I/O)."""
    keys = None if spec.keys is None else sorted(spec.keys)
    source = tuple(s.rstrip("/") for s in spec.source) if isinstance(spec.source, tuple) else spec.source.rstrip("/")
    return f"ds-{tokenize(source, options_json(spec.storage_options), keys, spec.block_size)[:16]}"


def open_source(spec) -> Source:
    """Open `spec.source`: a Zarr v3 group or array, a folder of class subfolders, or
    WebDataset tar shards (a list, a brace pattern, a `.tar` URL, or a folder of
    `.tar` files and no subfolders).

    Raises `SourceNotFoundError` if nothing is there, `SourceError` if the layout is
    unusable or holds no samples, `SpecError` if the spec does not fit the source.
    """
    options = dict(spec.storage_options or {})
    name = dataset_name(spec)
    shards = shard_urls(spec.source)
    if shards is not None:
        fs, paths = shard_paths(shards, options, spec)
        return open_webdataset(fs, paths, shards, shards_label(spec.source), options, spec, name)
    url = spec.source.rstrip("/")
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
            f"dataset {url} does not exist; pass a Zarr v3 group or array, a folder of class "
            "subfolders, or WebDataset .tar shards as Spec(source=...)"
        )
    if fs.exists(path.rstrip("/") + "/zarr.json"):
        source = open_zarr(url, options, spec, name)
        missing = [k for k in spec.keys or () if k not in source.info.fields]
        if missing:
            raise SpecError("keys", f"names among the source's arrays {list(source.info.fields)}", list(spec.keys))
        return source
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise SourceNotFoundError(f"dataset {url} is neither a Zarr v3 store nor a folder: {exc}") from exc
    tars = tar_files(entries)
    if tars:
        if any(e["type"] == "directory" for e in entries):
            raise SourceError(
                f"{url} holds both .tar files and subfolders: is it WebDataset shards or a folder of class "
                "subfolders? Pass the shards as a brace pattern or a list of URLs, or move the .tar files away")
        urls = [f"{url}/{t.rstrip('/').rsplit('/', 1)[-1]}" for t in tars]
        return open_webdataset(fs, tars, urls, url, options, spec, name)
    folder_fields(spec)  # a clear error now, before listing the class folders
    return open_folder(fs, path, url, options, spec, name, entries)
