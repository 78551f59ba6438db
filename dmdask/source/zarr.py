"""Zarr v3 sources: a group whose arrays share their first axis (samples), or one array
(field "data"); blocks are runs of whole chunks (docs/quickstart.md#sources). With
`Window(dim=...)`, the arrays of an xarray-written group whose first dimension is `dim`."""
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
    times: tuple[tuple[str, str, str], ...] = ()  # (field, numpy time unit, reference): CF times decoded


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
    dim = None if spec.window is None else spec.window.dim
    times = {}
    if dim is not None:
        arrays = _along(arrays, dim, url, chosen=spec.keys is not None)
        times = {name: found for name, found in ((n, _cf_times(a)) for n, a in arrays.items()) if found}
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
                       num_samples=int(n), block_len=int(block_len), nbytes=row_bytes * int(n),
                       field_types=_field_types(arrays, fields, times))
    layout = ZarrLayout(url, opts, tuple((f, paths[f]) for f in fields), identity,
                        tuple((f, *times[f]) for f in fields if f in times))
    return ZarrSource(info, layout, row_bytes)


def _field_types(arrays: dict, fields: tuple, times: dict) -> tuple | None:
    """`DatasetInfo.field_types` as `ZarrBlockReader` gives the rows (CF times as datetime64[ns]);
    None unless every array holds fixed-size numbers (strings and others: a block's rows tell)."""
    dtypes = {f: np.dtype("datetime64[ns]") if f in times else arrays[f].dtype for f in fields}
    if not all(isinstance(d, np.dtype) and d.kind in "biufcmM" for d in dtypes.values()):
        return None
    return tuple((f, dtypes[f].str, tuple(int(n) for n in arrays[f].shape[1:])) for f in fields)


class ZarrBlockReader(StoreReader):
    """Reads the chunks of one block, every field."""

    def __init__(self, layout: ZarrLayout, index: int, start: int, stop: int, nbytes: int):
        super().__init__(layout.url, layout.identity, index, start, stop, nbytes)
        self.layout = layout

    def _read(self) -> dict[str, np.ndarray]:
        out = {field: np.asarray(_array(self.layout, path)[self.start:self.stop]) for field, path in self.layout.paths}
        for field, unit, reference in self.layout.times:
            out[field] = np.datetime64(reference, "ns") + out[field].astype(f"timedelta64[{unit}]")
        return out


def _dimensions(array) -> tuple | None:
    """An array's dimension names: Zarr v3's `dimension_names`, or the `_ARRAY_DIMENSIONS`
    attribute xarray writes in Zarr v2; None when it names none."""
    names = getattr(array.metadata, "dimension_names", None) or array.attrs.get("_ARRAY_DIMENSIONS")
    return tuple(names) if names else None


def _along(arrays: dict, dim: str, url: str, chosen: bool) -> dict:
    """The arrays whose first dimension is `dim`; `SpecError` if one `chosen` (keys=), or one
    that has `dim` elsewhere, does not start with it, or if none does."""
    dims = {name: _dimensions(array) for name, array in arrays.items()}
    along = {name: array for name, array in arrays.items() if dims[name] and dims[name][0] == dim}
    astray = sorted(name for name in arrays if name not in along and (chosen or dim in (dims[name] or ())))
    if astray:
        raise SpecError("window", f"a dim that is the first dimension of every array read, but in {url} "
                        + ", ".join(f"{name} has {dims[name]}" for name in astray)
                        + f"; leave them out with Spec(keys=[...]), or write them with {dim!r} first "
                        f"(xarray: ds.transpose({dim!r}, ...))", dim)
    if not along:
        named = sorted({d for names in dims.values() if names for d in names})
        raise SpecError("window", f"a dim that is the first dimension of an array of {url}: one of {named}"
                        if named else f"no dim: the arrays of {url} do not name their dimensions", dim)
    return along


_CF_UNITS = {"days": "D", "hours": "h", "minutes": "m", "seconds": "s", "milliseconds": "ms",
             "microseconds": "us", "nanoseconds": "ns"}
_CF_CALENDARS = ("standard", "gregorian", "proleptic_gregorian")


def _cf_times(array) -> tuple[str, str] | None:
    """(numpy unit, reference time) of integer CF times ("hours since 2020-01-01") in a
    standard calendar, as xarray writes datetime coordinates; None for anything else."""
    units, calendar = array.attrs.get("units"), array.attrs.get("calendar", "standard")
    if array.dtype.kind not in "iu" or not isinstance(units, str) or calendar not in _CF_CALENDARS:
        return None
    unit, since, reference = units.partition(" since ")
    if not since or unit.strip().lower() not in _CF_UNITS:
        return None
    reference = reference.strip().replace(" ", "T").removesuffix("Z")
    try:
        np.datetime64(reference, "ns")
    except ValueError:
        return None
    return _CF_UNITS[unit.strip().lower()], reference


@functools.lru_cache(maxsize=64)
def _array(layout: ZarrLayout, path: str):
    """An array opened once per worker process and dataset (metadata read once)."""
    node = _open_node(layout.url, layout.options)
    return node if not path else node[path]


FORMAT = Format("zarr", claims=lambda place: place.exists and place.fs.exists(place.path.rstrip("/") + "/zarr.json"),
                open=open_zarr)
