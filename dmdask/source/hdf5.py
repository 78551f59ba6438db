"""HDF5 sources: the datasets of one file, or of one group in it (`/data/train.h5/images`),
that share their first axis (samples). Each worker process keeps a file open, with HDF5's
chunk cache off (docs/formats/hdf5.md)."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import threading
import warnings
from collections import Counter

import numpy as np
import zict

from ..errors import SourceError, SourceNotFoundError, SpecError
from .base import DatasetInfo, Source, StoreReader, filesystem, import_extra, options_json, protocol_of, string_dtype
from .registry import Format, Place

SIGNATURE = b"\x89HDF\r\n\x1a\n"
SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")
DEFAULT_BLOCK_BYTES = 8 << 20
READ_BLOCK = 1 << 16  # fsspec block size; reads are uncached ("none"), so each is one exact range
LOCAL = ("file", "local")


def h5py():
    """The h5py module, or an ImportError that names the extra to install."""
    return import_extra("h5py", "h5py>=3.9", "HDF5")


def split_inner(path: str) -> tuple[str, str] | None:
    """(file, group) when `path` goes on past a component named like an HDF5 file."""
    parts = path.split("/")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i].lower().endswith(SUFFIXES):
            return "/".join(parts[:i + 1]), "/".join(p for p in parts[i + 1:] if p)
    return None


@dataclasses.dataclass(frozen=True)
class HDF5Layout:
    """Where a dataset's fields live: shared by all of its block readers."""

    url: str
    protocol: str
    options: str  # storage options as JSON
    path: str  # the file, as its filesystem names it
    size: int
    group: str  # "" for the file's root group
    fields: tuple[tuple[str, str], ...]  # (name, kind): "fixed", "string" or "ragged"
    identity: str


def open_file(protocol: str, options: str, path: str, size: int):
    """(h5py.File read-only without chunk cache, the fsspec file under it or None)."""
    module = h5py()
    if protocol in LOCAL:
        return module.File(path, "r", rdcc_nbytes=0), None
    handle = filesystem(protocol, options).open(path, "rb", block_size=READ_BLOCK, cache_type="none", size=size)
    try:
        return module.File(handle, "r", rdcc_nbytes=0), handle
    except BaseException:
        handle.close()
        raise


def field_kind(ds) -> str | None:
    """"fixed", "string" or "ragged" for a dataset with a first axis; None otherwise."""
    module = h5py()
    if not ds.shape:
        return None
    string = module.check_string_dtype(ds.dtype)
    if string is not None:
        return "string" if string.length is None else "fixed"
    if module.check_vlen_dtype(ds.dtype) is not None:
        return "ragged"
    return None if ds.dtype.hasobject else "fixed"


class HDF5Source(Source):
    def __init__(self, info: DatasetInfo, layout: HDF5Layout, row_bytes: int | None):
        self.info, self.layout, self.row_bytes = info, layout, row_bytes

    def reader(self, k: int) -> HDF5BlockReader:
        start, stop = self.info.block_range(k)
        nbytes = None if self.row_bytes is None else self.row_bytes * (stop - start)
        return HDF5BlockReader(self.layout, k, start, stop, nbytes)


def open_hdf5(place: Place) -> HDF5Source:
    """Open the file and describe the blocks of it, or of the group the path names past it."""
    path, group = (place.path, "") if place.exists else split_inner(place.path)
    entry = place.fs.info(path)
    try:
        file, handle = open_file(protocol_of(place.fs), options_json(place.options), path, int(entry["size"]))
    except (OSError, ValueError) as exc:
        raise SourceError(f"cannot open HDF5 file {path}: {type(exc).__name__}: {exc}") from None
    try:
        try:
            node = file[group] if group else file
        except KeyError:
            raise SourceNotFoundError(f"HDF5 file {path} has no group {group!r}") from None
        if not isinstance(node, h5py().Group):
            raise SourceError(f"{group!r} in HDF5 file {path} is not a group")
        return _describe(node, place, path, group, entry)
    finally:
        _close(file, handle)


def _describe(node, place: Place, path: str, group: str, entry: dict) -> HDF5Source:
    url, spec, size = place.url, place.spec, int(entry["size"])
    # the file's version where its store tells one, so a file rewritten in place gets new
    # blocks (and a new open file on the workers: HDF5 caches the metadata it reads)
    stamp = {k: str(entry[k]) for k in ("mtime", "LastModified", "last_modified", "ETag", "etag") if k in entry}
    datasets = {name: obj for name, obj in node.items() if isinstance(obj, h5py().Dataset)}
    where = f"HDF5 file {path}" + (f", group {group!r}" if group else "")
    kinds = {name: field_kind(ds) for name, ds in datasets.items()}
    fields = tuple(sorted(_field_names(datasets, kinds, spec, where)))
    if any(kinds[f] == "string" for f in fields):
        string_dtype(f"the string datasets of {where}")
    n = int(datasets[fields[0]].shape[0])
    if n == 0:
        raise SourceError(f"dataset {url} has no samples: its datasets {list(fields)} have length 0 along the "
                          "first axis")
    chunked = [datasets[f].chunks[0] for f in fields if datasets[f].chunks]
    fixed = [f for f in fields if kinds[f] == "fixed"]
    row_bytes = sum(int(np.prod(datasets[f].shape[1:], dtype=np.int64)) * datasets[f].dtype.itemsize for f in fixed)
    if chunked:
        chunk = math.lcm(*chunked)
        block_len = spec.block_size or chunk
        if block_len % chunk:
            raise SpecError("block_size", f"a multiple of the chunk length {chunk} of {where}", spec.block_size)
    else:
        estimate = row_bytes + 16 * (len(fields) - len(fixed))
        block_len = spec.block_size or max(1, DEFAULT_BLOCK_BYTES // max(1, estimate))
    shapes = [(f, datasets[f].shape, datasets[f].dtype.str, datasets[f].chunks, datasets[f].compression,
               datasets[f].compression_opts) for f in fields]
    identity = place.identity("hdf5", url, group, fields, block_len, size, stamp, shapes)
    known = len(fixed) == len(fields)
    info = DatasetInfo(name=place.name, identity=identity, url=url, fields=fields, num_samples=n,
                       block_len=int(block_len), nbytes=row_bytes * n if known else None)
    layout = HDF5Layout(url, protocol_of(place.fs), options_json(place.options), path, size, group,
                        tuple((f, kinds[f]) for f in fields), identity)
    return HDF5Source(info, layout, row_bytes if known else None)


def _field_names(datasets: dict, kinds: dict, spec, where: str) -> list:
    """The datasets that are the fields: `spec.keys`, or those of the length most share."""
    if spec.keys is not None:
        if any(k not in datasets for k in spec.keys):
            raise SpecError("keys", f"names among the datasets {sorted(datasets)} of {where}", list(spec.keys))
        unusable = {k: f"{datasets[k].dtype} {datasets[k].shape}" for k in spec.keys if kinds[k] is None}
        if unusable:
            raise SpecError("keys", f"datasets with a first axis of numbers, records or strings (not {unusable})",
                            list(spec.keys))
        names = list(spec.keys)
        lengths = {k: datasets[k].shape[0] for k in names}
    else:
        lengths = {k: ds.shape[0] for k, ds in datasets.items() if kinds[k] is not None}
        if not lengths:
            raise SourceError(f"{where} holds no dataset dmdask can read (numbers, records or strings along a "
                              f"first axis): {sorted(datasets)}")
    counts = Counter(lengths.values()).most_common()  # named datasets must agree; else the most common wins
    if len(counts) > 1 and (spec.keys is not None or counts[0][1] == counts[1][1]):
        raise SourceError(f"the datasets of {where} disagree on their number of samples (first axis): "
                          f"{lengths}; pass Spec(keys=[...]) naming datasets of equal length")
    if spec.keys is None:
        names = [k for k, n in lengths.items() if n == counts[0][0]]
        ignored = {k: f"length {lengths[k]}" if k in lengths else f"{ds.dtype} {ds.shape}"
                   for k, ds in datasets.items() if k not in names}
        if ignored:
            warnings.warn(f"datasets of {where} not read: {ignored} (the samples are the {counts[0][0]} rows "
                          f"of {sorted(names)}; dmdask reads numbers, records and strings)")
    return names


class HDF5BlockReader(StoreReader):
    """Reads the rows of one block, every field, through the worker's open file."""

    def __init__(self, layout: HDF5Layout, index: int, start: int, stop: int, nbytes: int | None):
        super().__init__(layout.url, layout.identity, index, start, stop, nbytes)
        self.layout = layout

    def _read(self) -> dict[str, np.ndarray]:
        try:
            return _read_fields(self.layout, self.start, self.stop)
        except Exception as exc:
            _forget(self.layout)  # the next try opens the file afresh
            # Without the frames that held h5py objects: freed by the cyclic collector on fsspec's
            # IO thread, they would wait there for h5py's lock, held by a reader that waits on
            # that thread, forever (h5py#2019, dask#7547).
            raise exc.with_traceback(None)  # noqa: B904 - the same exception, its frames dropped


def _read_fields(layout: HDF5Layout, start: int, stop: int) -> dict[str, np.ndarray]:
    file = _opened(layout)
    node = file[layout.group] if layout.group else file
    out = {}
    for name, kind in layout.fields:
        if kind == "string":
            out[name] = node[name].asstr()[start:stop].astype(np.dtypes.StringDType())
        else:
            out[name] = node[name][start:stop]
    return out


MAX_OPEN = 16
_files = zict.LRU(MAX_OPEN, {})  # HDF5Layout -> (file, handle); one evicted is closed once no reader uses it
_files_lock = threading.Lock()


def _opened(layout: HDF5Layout):
    """The file, opened once per process (at most `MAX_OPEN` at a time)."""
    with _files_lock:
        if layout not in _files:
            _files[layout] = open_file(layout.protocol, layout.options, layout.path, layout.size)
        return _files[layout][0]


def _forget(layout: HDF5Layout) -> None:
    with _files_lock:
        _files.pop(layout, None)


@atexit.register
def _close_all() -> None:
    """Close the open files before the interpreter tears down (h5py over a Python file must not outlive it)."""
    with _files_lock:
        for file, handle in _files.values():
            with contextlib.suppress(Exception):
                _close(file, handle)
        _files.clear()


def _close(file, handle) -> None:
    file.close()
    if handle is not None:
        handle.close()


def _claims(place: Place) -> bool:
    """An HDF5 file (by its first bytes), or a path that goes on past one (a group)."""
    if place.exists:
        return place.head.startswith(SIGNATURE)
    inner = None if place.urls is not None or place.is_glob else split_inner(place.path)
    return inner is not None and place.has(inner[0])


FORMAT = Format("hdf5", claims=_claims, open=open_hdf5)
