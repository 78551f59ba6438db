"""Per-sample files, fields "data" (each file's bytes) and "label": a folder in
class-per-subfolder layout (ImageNet style), listed when opened, or a list of the files'
URLs, opened without a request (docs/quickstart.md#sources). The file list travels with
the block readers."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import SourceError, SpecError
from .base import DatasetInfo, Source, StoreReader, filesystem, options_json, protocol_of
from .registry import Format, Place

DEFAULT_FILES_PER_BLOCK = 256
LIST_THREADS = 16  # class folders listed at once
FIELDS = ("data", "label")


class FolderSource(Source):
    def __init__(self, info: DatasetInfo, protocol: str, options: str, files: list[str], labels: np.ndarray,
                 sizes: np.ndarray | None, listed: bool = False):
        self.info, self.protocol, self.options = info, protocol, options
        self.files, self.labels, self.sizes, self.listed = files, labels, sizes, listed

    def reader(self, k: int) -> FolderBlockReader:
        a, b = self.info.block_range(k)
        nbytes = None if self.sizes is None else block_nbytes(self.sizes[a:b], self.info.fields)
        return FolderBlockReader(self.info.url, self.protocol, self.options, self.files[a:b],
                                 self.labels[a:b], self.info.fields, self.info.identity, k, a, b, nbytes,
                                 self.listed, None if self.sizes is None else self.sizes[a:b])


def open_folder(place: Place) -> FolderSource:
    """Check the spec's keys, list the class folders (or take the listed files) and describe
    the blocks."""
    spec = place.spec
    fields = tuple(sorted(spec.keys or FIELDS))
    if any(f not in FIELDS for f in fields):
        raise SpecError("keys", f"names among {list(FIELDS)} for a folder source", list(spec.keys))
    if place.files is not None:
        (fs, files), url = place.listed_paths("sample files"), place.label("files")
        labels, sizes, relative = folder_labels(files), [None] * len(files), files
    else:
        (files, labels, sizes), fs, url = _list(place), place.fs, place.url
        root = place.path.rstrip("/")
        relative = [f[len(root) + 1:] if f.startswith(root + "/") else f for f in files]
    block_len = spec.block_size or DEFAULT_FILES_PER_BLOCK
    identity = place.identity("folder", url, fields, block_len, relative, sizes)
    size_array = None if any(s is None for s in sizes) else np.asarray(sizes, dtype=np.int64)
    nbytes = None if size_array is None else block_nbytes(size_array, fields)
    info = DatasetInfo(name=place.name, identity=identity, url=url, fields=fields,
                       num_samples=len(files), block_len=block_len, nbytes=nbytes)
    return FolderSource(info, protocol_of(fs), options_json(place.options), files, np.asarray(labels, dtype=np.int64),
                        size_array, place.files is not None)


def folder_labels(paths: list[str]) -> list[int]:
    """Each file's label: the index of its folder among the files' folders, sorted (as a
    folder source numbers its class subfolders)."""
    folders = [p.rstrip("/").rsplit("/", 1)[0] if "/" in p.rstrip("/") else "" for p in paths]
    index = {folder: i for i, folder in enumerate(sorted(set(folders)))}
    return [index[f] for f in folders]


def _list(place: Place):
    fs, url = place.fs, place.url
    classes = sorted(e["name"].rstrip("/") for e in place.listing if e["type"] == "directory")
    if not classes:
        raise SourceError(f"{url} is neither a Zarr v3 group (no zarr.json), Parquet or HDF5, a folder of "
                          "WebDataset .tar shards, nor a folder of class subfolders holding one file per sample")
    with ThreadPoolExecutor(min(LIST_THREADS, len(classes)), thread_name_prefix="dmdask-list") as pool:
        listings = list(pool.map(lambda cls: fs.ls(cls, detail=True), classes))
    found = [(label, e) for label, listing in enumerate(listings)
             for e in sorted(listing, key=lambda e: e["name"]) if e["type"] == "file"]
    if not found:
        raise SourceError(f"dataset {url} has no samples: its class subfolders hold no files")
    return [e["name"] for _, e in found], [label for label, _ in found], [e.get("size") for _, e in found]


def block_nbytes(sizes, fields) -> int:
    """Bytes a run of these files takes in memory: the files plus an object pointer each, and the labels."""
    n = len(sizes)
    return (int(np.sum(sizes)) + 8 * n if "data" in fields else 0) + (8 * n if "label" in fields else 0)


class ShortRead(ConnectionError):
    """A file's body was shorter or longer than the listing said (a cut transfer whose
    Content-Length agreed, or a file changed since it was listed): tried again, as a cut
    connection is, then `BlockReadError`."""


class FolderBlockReader(StoreReader):
    """Reads the files of one block, all of them or only some (row-granular). `listed`:
    the files were named one by one (else they are the folder `url`'s); `sizes`: each
    file's size as listed (None: not known), which every read is checked against.
    A transient error of some files retries those files only, with backoff: the files
    already read are kept for the read's next try, so each try makes progress."""

    row_granular = True

    def __init__(self, url, protocol, options, files, labels, fields, identity, index, start, stop, nbytes,
                 listed=False, sizes=None):
        super().__init__(url, identity, index, start, stop, nbytes)
        self.protocol, self.options, self.listed = protocol, options, listed
        self.files, self.labels, self.fields = list(files), np.asarray(labels, dtype=np.int64), fields
        self.sizes = None if sizes is None else np.asarray(sizes, dtype=np.int64)

    def sources(self) -> list[str]:
        """Each file the block reads (one may be a symbolic link out of the folder)."""
        fs = filesystem(self.protocol, self.options)
        return [fs.unstrip_protocol(f) for f in self.files]

    def read(self, on_retry=None) -> dict:
        return self.read_rows(np.arange(self.stop - self.start), on_retry)

    def read_rows(self, rows, on_retry=None) -> dict:
        kept: dict = {}  # row -> its file's bytes, kept from one try to the next
        return self._retrying(lambda: self._read_kept(rows, kept), on_retry)

    def _read_rows(self, rows) -> dict[str, np.ndarray]:
        return self._read_kept(rows, {})

    def _read_kept(self, rows, kept: dict) -> dict[str, np.ndarray]:
        """The given rows, fetching concurrently the files not in `kept` (adding those read);
        raises the first error once every file was tried."""
        rows = np.asarray(rows, dtype=np.int64)
        arrays = {}
        if "data" in self.fields:
            missing = sorted({int(r) for r in rows} - set(kept))
            contents = filesystem(self.protocol, self.options).cat_ranges(
                [self.files[r] for r in missing], None, None, on_error="return") if missing else []
            error = None
            for r, content in zip(missing, contents):
                if not isinstance(content, BaseException) and self.sizes is not None \
                        and self.sizes[r] >= 0 and len(content) != self.sizes[r]:
                    content = ShortRead(f"{self.files[r]}: read {len(content)} bytes, listed as {self.sizes[r]}")
                if isinstance(content, BaseException):
                    error = error or content
                else:
                    kept[r] = content
            if error is not None:
                raise error
            data = np.empty(len(rows), dtype=object)
            for i, r in enumerate(rows):
                data[i] = np.frombuffer(kept[int(r)], dtype=np.uint8)
            arrays["data"] = data
        if "label" in self.fields:
            arrays["label"] = self.labels[rows]
        return arrays


FORMAT = Format("folder", claims=lambda place: place.files is not None or place.exists, open=open_folder)
