"""Datasets on the shared store: their identity, their blocks, and how a block is read.

`open_source(spec)` reads only metadata (in the training process). Each block has a
small picklable `BlockReader` that a worker uses to read it from the shared store.

Two layouts:
- a Zarr v3 group whose arrays share their first axis (samples), or a single array
  (its field is then named "data"); blocks are whole chunks.
- a folder of per-sample files in class-per-subfolder layout: field "data" holds each
  sample's bytes as a uint8 array (an object array of them per batch), field "label"
  the int64 class index in sorted subfolder order; blocks are runs of files.
"""
from __future__ import annotations

import functools
import json
import math
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import fsspec
import numpy as np
from dask.base import tokenize

from .block import Block
from .errors import BlockReadError, SourceError, SourceNotFoundError, SpecError

DEFAULT_FILES_PER_BLOCK = 256


@dataclass(frozen=True)
class Source:
    """A dataset's metadata, as seen from the training process."""

    url: str
    identity: str  # stable token: URL plus a fingerprint of the metadata
    fields: Tuple[str, ...]
    bounds: np.ndarray  # block k holds samples bounds[k] .. bounds[k+1]-1
    readers: Tuple["BlockReader", ...]

    @property
    def num_samples(self) -> int:
        return int(self.bounds[-1])

    @property
    def num_blocks(self) -> int:
        return len(self.readers)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.readers)

    def block_of(self, sample_ids: np.ndarray) -> np.ndarray:
        """The block index of each sample id."""
        return np.searchsorted(self.bounds, sample_ids, side="right") - 1


class BlockReader:
    """Reads one block from the shared store. Picklable and small."""

    key: str
    index: int
    start: int
    stop: int
    nbytes: int  # decoded size, known from metadata
    url: str

    #: True when `read_rows` reads only the wanted samples from the store (one file per
    #: sample); False when the store's unit is the whole block (Zarr chunks).
    row_granular = False

    def read(self) -> Block:  # pragma: no cover - interface
        raise NotImplementedError

    def read_rows(self, rows):  # pragma: no cover - interface
        """Only the given rows (offsets in the block), for row-granular readers."""
        raise NotImplementedError

    def _fail(self, exc: BaseException) -> BlockReadError:
        return BlockReadError(self.url, self.index, self.start, self.stop, exc)


def block_key(identity: str, index: int) -> str:
    """The Dask key of a block: the same for every rank and every job."""
    return f"dmdask-block-{identity}-{index}"


def is_block_key(key) -> bool:
    return isinstance(key, str) and key.startswith("dmdask-block-")


def open_source(spec) -> Source:
    """Read the metadata of `spec.source` and split it into blocks.

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
        source = _open_zarr(url, options, spec)
    else:
        source = _open_folder(fs, path, url, options, spec)
    if spec.keys is not None:
        missing = [k for k in spec.keys if k not in source.fields]
        if missing:
            raise SpecError("keys", f"names among the source's arrays {list(source.fields)}", list(spec.keys))
    return source


# --- Zarr ---------------------------------------------------------------------------

def _zarr_node(url: str, options_json: str):
    """Open a Zarr node, reading its metadata now."""
    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open(store=url, mode="r", storage_options=json.loads(options_json) or None)


def _options_json(options) -> str:
    return json.dumps(options, sort_keys=True, default=str)


def _open_zarr(url: str, options: dict, spec) -> Source:
    import zarr

    try:
        node = _zarr_node(url, _options_json(options))
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"dataset {url} has no readable Zarr metadata: {exc}") from exc
    if isinstance(node, zarr.Array):
        arrays = {"data": node}
        paths = {"data": ""}
    else:
        arrays = {name: arr for name, arr in node.arrays()}
        if not arrays:
            raise SourceError(f"Zarr group {url} holds no arrays")
        if spec.keys is not None:
            unknown = [k for k in spec.keys if k not in arrays]
            if unknown:
                raise SpecError("keys", f"names among the source's arrays {sorted(arrays)}", list(spec.keys))
            arrays = {k: arrays[k] for k in spec.keys}
        paths = {name: name for name in arrays}
    lengths = {name: arr.shape[0] if arr.ndim else None for name, arr in arrays.items()}
    if None in lengths.values() or len(set(lengths.values())) != 1:
        raise SourceError(
            f"the arrays of {url} must share their first axis (samples), but their lengths "
            f"are {lengths}; pass Spec(keys=[...]) naming arrays of equal length"
        )
    fields = tuple(sorted(arrays))
    n = next(iter(lengths.values()))
    chunk = 1
    for name in fields:
        chunk = math.lcm(chunk, arrays[name].chunks[0])
    block_len = spec.block_size or chunk
    if block_len % chunk:
        raise SpecError("block_size", f"a multiple of the chunk length {chunk} of {url}", spec.block_size)
    metadata = {name: arrays[name].metadata.to_dict() for name in fields}
    identity = tokenize("zarr", url, fields, block_len, json.dumps(metadata, sort_keys=True, default=str))[:16]
    bounds = np.array(list(range(0, n, block_len)) + [n], dtype=np.int64)
    if n == 0:
        bounds = np.array([0], dtype=np.int64)
    row_bytes = {name: int(np.prod(arrays[name].shape[1:], dtype=np.int64)) * arrays[name].dtype.itemsize
                 for name in fields}
    options_json = _options_json(options)
    readers = tuple(
        ZarrBlockReader(url, options_json, {f: paths[f] for f in fields}, identity, k,
                        int(bounds[k]), int(bounds[k + 1]), sum(row_bytes.values()) * int(bounds[k + 1] - bounds[k]))
        for k in range(len(bounds) - 1)
    )
    return Source(url, identity, fields, bounds, readers)


class ZarrBlockReader(BlockReader):
    def __init__(self, url, options_json, paths: Dict[str, str], identity, index, start, stop, nbytes):
        self.url, self.options_json, self.paths = url, options_json, paths
        self.identity, self.index, self.start, self.stop, self.nbytes = identity, index, start, stop, nbytes
        self.key = block_key(identity, index)

    def read(self) -> Block:
        try:
            arrays = {}
            for field, path in self.paths.items():
                arr = _zarr_array(self.url, self.options_json, path, self.identity)
                arrays[field] = np.asarray(arr[self.start:self.stop])
        except Exception as exc:
            raise self._fail(exc) from exc
        return Block(arrays, self.start, self.stop)


@functools.lru_cache(maxsize=64)
def _zarr_array(url: str, options_json: str, path: str, identity: str):
    """An array opened once per worker process and dataset identity (metadata read once)."""
    node = _zarr_node(url, options_json)
    return node if not path else node[path]


# --- folders of files ---------------------------------------------------------------

_listings: "OrderedDict[tuple, tuple]" = OrderedDict()  # (url, options) -> (files, labels, sizes)
_listings_lock = threading.Lock()
MAX_LISTINGS = 8


def forget_listing(url: str, options: Optional[dict] = None) -> None:
    """Drop this process's listing of a folder source, so the next open lists it again."""
    with _listings_lock:
        _listings.pop((url.rstrip("/"), _options_json(options or {})), None)


def _list_folder(fs, path: str, url: str, options: dict):
    """Files, labels and sizes of a folder source, listed once per process.

    A listing costs a request per class folder, and over HTTP a HEAD per file for the
    sizes; a training run reads the same folder every epoch, so it is kept (see
    `forget_listing`, called by `dmdask.release`)."""
    cache_key = (url, _options_json(options))
    with _listings_lock:  # held while listing: concurrent ranks of a process list once
        if cache_key not in _listings:
            _listings[cache_key] = _read_listing(fs, path, url)
            while len(_listings) > MAX_LISTINGS:
                _listings.popitem(last=False)
        _listings.move_to_end(cache_key)
        return _listings[cache_key]


def _read_listing(fs, path: str, url: str):
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise SourceNotFoundError(f"dataset {url} is neither a Zarr v3 store nor a folder: {exc}") from exc
    classes = sorted(e["name"].rstrip("/") for e in entries if e["type"] == "directory")
    if not classes:
        raise SourceError(
            f"{url} is neither a Zarr v3 group (no zarr.json) nor a folder of class "
            "subfolders holding one file per sample"
        )
    files: List[str] = []
    labels: List[int] = []
    sizes: List[Optional[int]] = []
    for label, cls in enumerate(classes):
        for e in sorted(fs.ls(cls, detail=True), key=lambda e: e["name"]):
            if e["type"] == "file":
                files.append(e["name"])
                labels.append(label)
                sizes.append(e.get("size"))
    if not files:
        raise SourceError(f"the class subfolders of {url} hold no files")
    if any(s is None for s in sizes):
        sizes = list(fs.sizes(files))
    return files, labels, sizes


def _open_folder(fs, path: str, url: str, options: dict, spec) -> Source:
    files, labels, sizes = _list_folder(fs, path, url, options)
    fields = tuple(sorted(spec.keys or ("data", "label")))
    for f in fields:
        if f not in ("data", "label"):
            raise SpecError("keys", "names among ['data', 'label'] for a folder source", list(spec.keys))
    block_len = spec.block_size or DEFAULT_FILES_PER_BLOCK
    n = len(files)
    bounds = np.array(list(range(0, n, block_len)) + [n], dtype=np.int64)
    root = path.rstrip("/")
    rel = [f[len(root) + 1:] if f.startswith(root + "/") else f for f in files]
    identity = tokenize("folder", url, fields, block_len, rel, sizes)[:16]
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    readers = tuple(
        FolderBlockReader(url, protocol, _options_json(options), files[a:b], labels[a:b], fields,
                          identity, k, a, b, _folder_block_nbytes(sizes[a:b], fields))
        for k, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    )
    return Source(url, identity, fields, bounds, readers)


def _folder_block_nbytes(sizes, fields) -> int:
    """Bytes a block of these files takes in memory: the files plus an object pointer
    per sample ("data"), and 8 bytes a label ("label")."""
    n = len(sizes)
    return (sum(sizes) + 8 * n if "data" in fields else 0) + (8 * n if "label" in fields else 0)


_fs_lock = threading.Lock()


@functools.lru_cache(maxsize=16)
def _filesystem(protocol: str, options_json: str):
    return fsspec.filesystem(protocol, **json.loads(options_json))


class FolderBlockReader(BlockReader):
    def __init__(self, url, protocol, options_json, files, labels, fields, identity, index, start, stop, nbytes):
        self.url, self.protocol, self.options_json = url, protocol, options_json
        self.files, self.labels, self.fields = list(files), list(labels), fields
        self.identity, self.index, self.start, self.stop, self.nbytes = identity, index, start, stop, nbytes
        self.key = block_key(identity, index)

    row_granular = True

    def read(self) -> Block:
        return Block(self.read_rows(np.arange(self.stop - self.start)), self.start, self.stop)

    def read_rows(self, rows):
        arrays = {}
        try:
            if "data" in self.fields:
                with _fs_lock:
                    fs = _filesystem(self.protocol, self.options_json)
                files = [self.files[r] for r in rows]
                contents = fs.cat(files, on_error="raise")
                data = np.empty(len(files), dtype=object)
                for i, name in enumerate(files):
                    data[i] = np.frombuffer(_lookup(contents, name, fs), dtype=np.uint8)
                arrays["data"] = data
        except Exception as exc:
            raise self._fail(exc) from exc
        if "label" in self.fields:
            arrays["label"] = np.asarray(self.labels, dtype=np.int64)[rows]
        return arrays


def _lookup(contents: dict, name: str, fs) -> bytes:
    if name in contents:
        return contents[name]
    stripped = fs._strip_protocol(name)
    for key, value in contents.items():
        if fs._strip_protocol(key) == stripped:
            return value
    raise FileNotFoundError(name)


def sample_ranges(bounds: np.ndarray) -> Sequence[Tuple[int, int]]:
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
