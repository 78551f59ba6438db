"""Datasets on the shared store: their description and how a block is read.

`dataset_name(spec)` names the dataset a spec reads, with no I/O: the cluster's
registry knows a dataset by it, so a rank that joins a dataset already created reads
nothing from the shared store to plan its epoch. `open_source(spec)` reads what creating
the blocks needs (Zarr or HDF5 metadata, Parquet footers, tar headers, a folder's
listing); only the process that creates a dataset's blocks calls it, once per cluster.
The cluster keeps a dataset as it was when first opened: after changing it in place,
`dmdask.release` it.
"""
from __future__ import annotations

import fsspec
from dask.base import tokenize

from ..errors import SourceError, SourceNotFoundError, SpecError
from .urls import LOCAL_PROTOCOLS, normalize
from .base import BlockReader, DatasetInfo, Source, block_key, is_block_key, options_json, parse_block_key
from .folder import folder_fields, open_folder
from .hdf5 import SIGNATURE as HDF5_SIGNATURE
from .hdf5 import open_hdf5, split_inner
from .parquet import MAGIC as PARQUET_MAGIC
from .parquet import is_parquet_name, open_parquet
from .webdataset import open_webdataset, shard_paths, shard_urls, shards_label, tar_files
from .zarr import open_zarr

LAYOUTS = ("a Zarr v3 group or array, a Parquet file, folder of Parquet files or glob, an HDF5 file "
           "(or a group in it: file.h5/group), WebDataset .tar shards, or a folder of class subfolders")

__all__ = ["BlockReader", "DatasetInfo", "Source", "block_key", "dataset_name", "is_block_key", "open_source",
           "parse_block_key"]


def dataset_name(spec) -> str:
    """The registry name of the dataset `spec` reads: its URL (or shard URLs) in one
    spelling (a local path or `file://` URL absolute, without `.` and `..`), storage
    options, fields and block size (no I/O)."""
    keys = None if spec.keys is None else sorted(spec.keys)
    source = tuple(map(_named, spec.source)) if isinstance(spec.source, tuple) else _named(spec.source)
    return f"ds-{tokenize(source, options_json(spec.storage_options), keys, spec.block_size)[:16]}"


def _named(url: str) -> str:
    if "::" not in url and ("://" not in url or url.startswith(LOCAL_PROTOCOLS)):
        return normalize(url)
    return url.rstrip("/")


def open_source(spec) -> Source:
    """Open `spec.source`, by what it names or its URL holds: WebDataset tar shards (a
    list, a brace pattern, a `.tar` URL); a Zarr v3 group or array (a zarr.json); a
    Parquet file, or an HDF5 file, by its first bytes; an HDF5 group (a path that goes
    on past an HDF5 file's name); a glob of Parquet files; a folder that holds Parquet
    files (*.parquet, *.parq, *.pq) or `.tar` shards (and no subfolders); otherwise a
    folder of class subfolders.

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
    exists = _exists(fs, path, url)
    if not exists:
        if any(c in path for c in "*?["):  # a glob: the files it matches are Parquet files
            matches = fs.glob(path, detail=True)
            files = [f for f, entry in matches.items() if entry.get("type", "file") == "file"]
            if not files:
                raise SourceNotFoundError(f"dataset {url} matches no files")
            return open_parquet(fs, files, url, options, spec, name)
        inner = split_inner(path)
        if inner is not None and _exists(fs, inner[0], url):
            return open_hdf5(fs, inner[0], inner[1], url, options, spec, name)
        raise SourceNotFoundError(f"dataset {url} does not exist; pass {LAYOUTS} as Spec(source=...)")
    if fs.exists(path.rstrip("/") + "/zarr.json"):
        source = open_zarr(url, options, spec, name)
        missing = [k for k in spec.keys or () if k not in source.info.fields]
        if missing:
            raise SpecError("keys", f"names among the source's arrays {list(source.info.fields)}", list(spec.keys))
        return source
    head = _first_bytes(fs, path)
    if head.startswith(PARQUET_MAGIC):
        return open_parquet(fs, [path], url, options, spec, name)
    if head.startswith(HDF5_SIGNATURE):
        return open_hdf5(fs, path, "", url, options, spec, name)
    entries = _listing(fs, path, url)
    files = sorted(e["name"] for e in entries if e["type"] == "file" and is_parquet_name(e["name"]))
    if files:
        return open_parquet(fs, files, url, options, spec, name)
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


def _first_bytes(fs, path: str) -> bytes:
    """The first 8 bytes of a file (one small range read); b"" for a folder."""
    try:
        return fs.cat_file(path, start=0, end=8)
    except (IsADirectoryError, FileNotFoundError):
        return b""


def _listing(fs, path: str, url: str) -> list:
    try:
        return fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise SourceNotFoundError(f"dataset {url} is none of {LAYOUTS}: {exc}") from exc
