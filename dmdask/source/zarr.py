"""Zarr v3 sources: a group whose arrays share their first axis (samples), or one array
(field "data"); blocks are runs of whole chunks (docs/quickstart.md#sources)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings

import numpy as np

from ..errors import SourceError, SourceNotFoundError, SpecError
from .base import DatasetInfo, Source, StoreReader, options_json, read_options
from .registry import Format, Place


def _open_node(url: str, options: str):
    import zarr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        return zarr.open(store=url, mode="r", storage_options=read_options(protocol, json.loads(options)) or None)


@dataclasses.dataclass(frozen=True)
class ZarrLayout:
    """Where a Zarr dataset's fields live: shared by all of its block readers."""

    url: str
    options: str  # storage options as JSON
    paths: tuple[tuple[str, str], ...]  # (field, path in the group; "" for a lone array)
    identity: str


class ZarrSource(Source):
    def __init__(self, info: DatasetInfo, layout: ZarrLayout, row_bytes: int):
        self.info, self.layout, self.row_bytes = info, layout, row_bytes

    def reader(self, k: int) -> ZarrBlockReader:
        start, stop = self.info.block_range(k)
        return ZarrBlockReader(self.layout, k, start, stop, self.row_bytes * (stop - start))


def open_zarr(place: Place) -> ZarrSource:
    """Read the metadata of a Zarr v3 node (a few small requests) and describe its blocks."""
    import zarr

    url, spec, opts = place.url, place.spec, options_json(place.options)
    try:
        node = _open_node(url, opts)
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"dataset {url} has no readable Zarr metadata: {exc}") from exc
    if isinstance(node, zarr.Array):
        arrays, paths = {"data": node}, {"data": ""}
    else:
        arrays = dict(node.arrays())
        if not arrays:
            raise SourceError(f"Zarr group {url} holds no arrays")
        paths = {name: name for name in arrays}
    if spec.keys is not None:
        if any(k not in arrays for k in spec.keys):
            raise SpecError("keys", f"names among the source's arrays {sorted(arrays)}", list(spec.keys))
        arrays = {k: arrays[k] for k in spec.keys}
    lengths = {name: arr.shape[0] if arr.ndim else None for name, arr in arrays.items()}
    if None in lengths.values() or len(set(lengths.values())) != 1:
        raise SourceError(f"the arrays of {url} must share their first axis (samples), but their lengths "
                          f"are {lengths}; pass Spec(keys=[...]) naming arrays of equal length")
    fields = tuple(sorted(arrays))
    n = next(iter(lengths.values()))
    if n == 0:
        raise SourceError(f"dataset {url} has no samples: its arrays {list(fields)} have length 0 "
                          "along the first axis")
    chunk = math.lcm(*(arrays[name].chunks[0] for name in fields))
    block_len = spec.block_size or chunk
    if block_len % chunk:
        raise SpecError("block_size", f"a multiple of the chunk length {chunk} of {url}", spec.block_size)
    metadata = json.dumps({name: arrays[name].metadata.to_dict() for name in fields}, sort_keys=True, default=str)
    identity = place.identity("zarr", url, fields, block_len, metadata)
    row_bytes = sum(int(np.prod(arrays[f].shape[1:], dtype=np.int64)) * arrays[f].dtype.itemsize for f in fields)
    info = DatasetInfo(name=place.name, identity=identity, url=url, fields=fields,
                       num_samples=int(n), block_len=int(block_len), nbytes=row_bytes * int(n))
    layout = ZarrLayout(url, opts, tuple((f, paths[f]) for f in fields), identity)
    return ZarrSource(info, layout, row_bytes)


class ZarrBlockReader(StoreReader):
    """Reads the chunks of one block, every field."""

    def __init__(self, layout: ZarrLayout, index: int, start: int, stop: int, nbytes: int):
        super().__init__(layout.url, layout.identity, index, start, stop, nbytes)
        self.layout = layout

    def _read(self) -> dict[str, np.ndarray]:
        return {field: np.asarray(_array(self.layout, path)[self.start:self.stop]) for field, path in self.layout.paths}


@functools.lru_cache(maxsize=64)
def _array(layout: ZarrLayout, path: str):
    """An array opened once per worker process and dataset (metadata read once)."""
    node = _open_node(layout.url, layout.options)
    return node if not path else node[path]


FORMAT = Format("zarr", claims=lambda place: place.exists and place.fs.exists(place.path.rstrip("/") + "/zarr.json"),
                open=open_zarr)
