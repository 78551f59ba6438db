"""Parquet sources: one file, a folder of them, or a glob; samples are rows (over the
files in name order), fields the top-level columns; blocks are whole row groups, each
reader carrying its own cut of the footer (docs/formats/parquet.md)."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import warnings

import numpy as np

from ..errors import SourceError, SourceNotFoundError, SpecError, redact
from .base import DatasetInfo, Source, StoreReader, filesystem, import_extra, options_json, protocol_of, string_dtype
from .parquet_footer import MAGIC, Footer, framed, read_footers
from .registry import Format, Place

logger = logging.getLogger(__name__)

SUFFIXES = (".parquet", ".parq", ".pq")
READ_BLOCK = 1 << 16  # fsspec block size; reads are uncached ("none"), so each is one exact range


def pyarrow():
    """(pyarrow, pyarrow.parquet), or an ImportError that names the extra to install."""
    return import_extra("pyarrow", "pyarrow>=14", "Parquet"), import_extra("pyarrow.parquet", "pyarrow>=14", "Parquet")


def is_parquet_name(name: str) -> bool:
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return base.lower().endswith(SUFFIXES) and not base.startswith(("_", "."))


def column_kind(t) -> str | None:
    """"fixed", "binary" or "string" for an Arrow type dmdask reads as a field; None otherwise."""
    types = pyarrow()[0].types

    def is_any(*tests: str) -> bool:  # getattr: the view types came in pyarrow 16
        return any(getattr(types, test, lambda _: False)(t) for test in tests)

    if is_any("is_string", "is_large_string", "is_string_view"):
        return "string"
    if is_any("is_binary", "is_large_binary", "is_binary_view", "is_fixed_size_binary"):
        return "binary"
    while types.is_fixed_size_list(t):
        t = t.value_type
    return "fixed" if types.is_integer(t) or types.is_floating(t) or types.is_boolean(t) else None


def row_nbytes(t) -> int:
    """Bytes a row of a "fixed" column takes as numpy."""
    types, size = pyarrow()[0].types, 1
    while types.is_fixed_size_list(t):
        size, t = size * t.list_size, t.value_type
    return size * np.dtype(t.to_pandas_dtype()).itemsize


def to_numpy(column, name: str) -> np.ndarray:
    """A column (a pyarrow ChunkedArray) as dmdask's arrays; ValueError on null values."""
    types, arr = pyarrow()[0].types, column.combine_chunks()
    kind, shape = column_kind(arr.type), [len(arr)]
    while True:
        if arr.null_count:
            raise ValueError(f"column {name!r} holds {arr.null_count} null values, which dmdask cannot batch")
        if not types.is_fixed_size_list(arr.type):
            break
        shape.append(arr.type.list_size)
        arr = arr.flatten()
    if kind == "string":
        return arr.to_numpy(zero_copy_only=False).astype(np.dtypes.StringDType())
    if kind == "binary":
        out = np.empty(len(arr), dtype=object)
        for i, value in enumerate(arr.to_numpy(zero_copy_only=False)):
            out[i] = np.frombuffer(value, dtype=np.uint8)
        return out
    return arr.to_numpy(zero_copy_only=False).reshape(shape)


@dataclasses.dataclass(frozen=True)
class FilePart:
    """The row groups of one file that a block reads, with their footer."""

    path: str
    size: int
    rows: tuple[int, int]  # the block's rows in this file: start, stop
    footer: bytes  # the file's footer cut to these row groups


class ParquetSource(Source):
    def __init__(self, info: DatasetInfo, protocol: str, options: str, files: list[str], sizes: list[int],
                 footers: list[Footer], groups: np.ndarray, row_bytes: int | None):
        self.info, self.protocol, self.options = info, protocol, options
        self.files, self.sizes, self.footers = files, sizes, footers
        self.groups = groups  # per non-empty row group: file, index and first row in it, first sample, rows
        self.row_bytes = row_bytes

    def reader(self, k: int) -> ParquetBlockReader:
        a, b = self.info.block_range(k)
        first = self.groups["start"]
        mine = self.groups[np.searchsorted(first, a):np.searchsorted(first, b)]
        parts = []
        for f in np.unique(mine["file"]):
            groups = mine[mine["file"] == f]
            start, rows = int(groups["row"][0]), int(groups["rows"].sum())
            footer = self.footers[f].subset(groups["index"].tolist(), rows)
            parts.append(FilePart(self.files[f], self.sizes[f], (start, start + rows), footer))
        nbytes = None if self.row_bytes is None else self.row_bytes * (b - a)
        return ParquetBlockReader(self.info.url, self.protocol, self.options, self.info.fields, tuple(parts),
                                  self.info.identity, k, a, b, nbytes)


def open_parquet(place: Place) -> ParquetSource:
    """Read the footers of the Parquet files at `place` and describe the blocks. `SourceError`
    names the file (and its samples) when a footer is missing or corrupt or a file lacks a
    column of the first."""
    pa, pq = pyarrow()
    fs, url, spec, files = place.fs, place.url, place.spec, sorted(_files(place))
    if not files:
        raise SourceNotFoundError(f"dataset {url} matches no Parquet files")
    sizes = [int(s) for s in fs.sizes(files)]
    digest, footers, metas, first = hashlib.sha256(), [], [], 0
    for path, data in zip(files, read_footers(fs, files, sizes)):
        try:
            if isinstance(data, str):
                raise ValueError(data)
            footer = Footer(data)
            meta = pq.read_metadata(pa.BufferReader(framed(data)))
        except Exception as exc:
            raise SourceError(f"cannot read the Parquet footer of {path} (the file of the samples from {first} "
                              f"on): {type(exc).__name__}: {exc}") from None
        digest.update(data)
        footers.append(footer)
        metas.append(meta)
        first += meta.num_rows
    schema = metas[0].schema.to_arrow_schema()
    fields, kinds = _fields(schema, spec, files[0])
    groups = _check_and_list(files, metas, schema, fields)
    n = int(groups["rows"].sum())
    if n == 0:
        raise SourceError(f"dataset {url} has no samples: its Parquet files hold no rows")
    block_len = _block_len(url, groups, n, spec.block_size)
    identity = place.identity("parquet", url, fields, block_len, files, sizes, digest.hexdigest())
    row_bytes = None if any(k != "fixed" for k in kinds.values()) else sum(
        row_nbytes(schema.field(f).type) for f in fields)
    info = DatasetInfo(name=place.name, identity=identity, url=url, fields=fields, num_samples=n,
                       block_len=block_len, nbytes=None if row_bytes is None else row_bytes * n)
    return ParquetSource(info, protocol_of(fs), options_json(place.options), files, sizes, footers, groups, row_bytes)


def _fields(schema, spec, path: str):
    """The fields (sorted names) and their kinds, from the first file's schema."""
    kinds = {name: column_kind(schema.field(name).type) for name in schema.names}
    if spec.keys is not None:
        if any(k not in kinds for k in spec.keys):
            raise SpecError("keys", f"names among the Parquet columns {schema.names} of {path}", list(spec.keys))
        unusable = {k: str(schema.field(k).type) for k in spec.keys if kinds[k] is None}
        if unusable:
            raise SpecError("keys", "columns of numbers, fixed-size lists of numbers, binary or strings "
                                    f"(not {unusable})", list(spec.keys))
        names = list(spec.keys)
    else:
        names = [k for k, kind in kinds.items() if kind is not None]
        skipped = {k: str(schema.field(k).type) for k, kind in kinds.items() if kind is None}
        if skipped:
            warnings.warn(f"Parquet columns {skipped} of {path} are not read: dmdask reads numbers, fixed-size "
                          "lists of numbers, binary and strings")
        if not names:
            raise SourceError(f"the Parquet files of {path} have no column dmdask can read: {skipped}")
    fields = tuple(sorted(names))
    if any(kinds[f] == "string" for f in fields):
        string_dtype(f"the string columns of {path}")
    return fields, {f: kinds[f] for f in fields}


def _check_and_list(files: list[str], metas: list, first, fields: tuple[str, ...]) -> np.ndarray:
    """Every file has the fields, with the types of the `first` file's schema; its non-empty row groups."""
    rows, start = [], 0
    for f, (path, meta) in enumerate(zip(files, metas)):
        schema = meta.schema.to_arrow_schema()
        where = f"{path} (samples {start}..{start + meta.num_rows - 1})"
        for name in fields:
            if name not in schema.names:
                raise SourceError(f"{where} has no column {name!r}, which {files[0]} has; pass "
                                  "Spec(keys=[...]) naming columns every file has")
            if not schema.field(name).type.equals(first.field(name).type):
                raise SourceError(f"column {name!r} of {where} is {schema.field(name).type}, but "
                                  f"{first.field(name).type} in {files[0]}")
        row = 0
        for g in range(meta.num_row_groups):
            count = meta.row_group(g).num_rows
            if count:
                rows.append((f, g, row, start + row, count))
            row += count
        start += row
    return np.array(rows, dtype=[("file", "i8"), ("index", "i8"), ("row", "i8"), ("start", "i8"), ("rows", "i8")])


def _block_len(url: str, groups: np.ndarray, n: int, asked: int | None) -> int:
    """The smallest number of rows B whose multiples below n all fall on row-group
    boundaries (so every block is whole row groups), or `asked` if it is such a B."""
    bounds = np.append(groups["start"], n)

    def aligned(b: int) -> bool:
        multiples = np.arange(b, n, b, dtype=np.int64)
        at = np.searchsorted(bounds, multiples)
        return bool(np.all(bounds[np.minimum(at, len(bounds) - 1)] == multiples))

    smallest = next(int(b) for b in bounds[1:] if aligned(int(b)))
    if asked is not None:
        if not aligned(asked):
            raise SpecError("block_size", f"a number of rows whose multiples fall on row-group boundaries of "
                                          f"{url}, such as {smallest}", asked)
        return asked
    largest = int(groups["rows"].max())
    if smallest > largest:
        logger.warning("the row groups of %s do not line up into blocks of one row group: blocks are %d rows "
                       "(row groups have up to %d)", redact(url), smallest, largest)
    return smallest


class ParquetBlockReader(StoreReader):
    """Reads the column chunks of one block's row groups (of its fields only)."""

    def __init__(self, url: str, protocol: str, options: str, fields: tuple[str, ...], parts: tuple[FilePart, ...],
                 identity: str, index: int, start: int, stop: int, nbytes: int | None):
        super().__init__(url, identity, index, start, stop, nbytes)
        self.protocol, self.options, self.fields, self.parts = protocol, options, fields, parts

    def sources(self) -> list[str]:
        """Each file the block reads (one may be a symbolic link out of the folder)."""
        fs = filesystem(self.protocol, self.options)
        return [fs.unstrip_protocol(part.path) for part in self.parts]

    def _read(self) -> dict[str, np.ndarray]:
        pieces = [self._read_part(part) for part in self.parts]
        if len(pieces) == 1:
            return pieces[0]
        return {name: np.concatenate([piece[name] for piece in pieces]) for name in self.fields}

    def _read_part(self, part: FilePart) -> dict[str, np.ndarray]:
        pa, pq = pyarrow()
        try:
            meta = pq.read_metadata(pa.BufferReader(framed(part.footer)))
            fs = filesystem(self.protocol, self.options)
            with fs.open(part.path, "rb", block_size=READ_BLOCK, cache_type="none", size=part.size) as f:
                table = pq.ParquetFile(f, metadata=meta, pre_buffer=False).read_row_groups(
                    list(range(meta.num_row_groups)), columns=list(self.fields), use_threads=False)
            if table.num_rows != part.rows[1] - part.rows[0]:
                raise ValueError(f"read {table.num_rows} rows, expected {part.rows[1] - part.rows[0]}")
            return {name: to_numpy(table.column(name), name) for name in self.fields}
        except Exception as exc:  # the store's error stays the cause, so a transient one is retried
            raise OSError(f"{part.path} (its rows {part.rows[0]}..{part.rows[1] - 1}): "
                          f"{type(exc).__name__}: {exc}") from exc


def _files(place: Place) -> list[str]:
    """The Parquet files at `place`: a glob's matches, the file, or a folder's (*.parquet, *.parq, *.pq)."""
    if place.is_glob:
        matches = place.fs.glob(place.path, detail=True)
        files = [f for f, entry in matches.items() if entry.get("type", "file") == "file"]
        if not files:
            raise SourceNotFoundError(f"dataset {place.url} matches no files")
        return files
    if place.head.startswith(MAGIC):
        return [place.path]
    return sorted(e["name"] for e in place.listing if e["type"] == "file" and is_parquet_name(e["name"]))


FORMAT = Format("parquet", claims=lambda place: place.is_glob or bool(_files(place)), open=open_parquet)
