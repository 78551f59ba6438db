"""One file on the store as a dataset of byte rows (field "data", rows of `ROW_BYTES`): what
transparent mode (`dmdask.fs`) caches. Opening reads nothing; a block is one ranged read
(docs/architecture.md, `dmdask.source.files`; docs/transparent.md, "Freshness")."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os

import fsspec
import fsspec.asyn
import numpy as np

from .base import DatasetInfo, Source, StoreReader, filesystem

ROW_BYTES = 64 << 10
FIELDS = ("data",)


def file_identity(url: str, options: str, size: int, version, block_bytes: int) -> str:
    """The token naming a file's dataset (registry name `fs-<token>`) and its blocks: a file
    changed in size or version is another dataset, with new blocks."""
    described = json.dumps(["file-bytes", url, options, size, version, block_bytes], default=str)
    return hashlib.blake2b(described.encode(), digest_size=8).hexdigest()


def read_blocks(readers) -> list:
    """Each block's bytes from the store, one ranged request per block (concurrent on an async
    filesystem), or the exception its read raised (`FileChanged` when the file is no longer
    the version its dataset was opened at). The readers are of files on one filesystem."""
    first = readers[0]
    try:
        fs = fsspec.filesystem(first.protocol, **json.loads(first.options))  # this process's own (fsspec's cache)
        if not getattr(fs, "async_impl", False):
            return [_or_error(r.read_bytes, fs) for r in readers]
        return fsspec.asyn.sync(fs.loop, _read_all, readers, fs)
    except Exception as exc:  # noqa: BLE001 - the caller leaves these blocks to their workers
        return [exc] * len(readers)


async def _read_all(readers, fs) -> list:
    """On the filesystem's loop (the reads made there, so none is left unawaited if the call fails)."""
    return await asyncio.gather(*(r.read_bytes_async(fs) for r in readers), return_exceptions=True)


def _or_error(read, *args):
    try:
        return read(*args)
    except Exception as exc:  # noqa: BLE001 - returned, as cat_ranges(on_error="return") does
        return exc


class FileChanged(OSError):
    """A block's file is no longer the version its dataset was opened at."""


def _precondition(protocol: str, version) -> dict:
    """Keyword arguments of a ranged read that make the store refuse another version of the
    file (HTTP's If-Match on the ETag, S3's version id); {} where the store offers neither."""
    fields = dict(version or ())
    if protocol in ("http", "https") and fields.get("ETag"):
        return {"headers": {"If-Match": fields["ETag"]}}
    if protocol in ("s3", "s3a") and fields.get("VersionId"):
        return {"version_id": fields["VersionId"]}
    return {}


class FileSource(Source):
    """A file of known size and version, as byte rows."""

    def __init__(self, url: str, protocol: str, options: str, path: str, size: int, version, block_bytes: int):
        if size <= 0:
            raise ValueError(f"{url}: an empty file has no blocks")
        block_bytes = self.block_bytes_of(block_bytes)
        identity = file_identity(url, options, size, version, block_bytes)
        rows = -(-size // ROW_BYTES)
        self.info = DatasetInfo(name=f"fs-{identity}", identity=identity, url=url, fields=FIELDS, num_samples=rows,
                                block_len=block_bytes // ROW_BYTES, nbytes=size + 8 * rows)
        self.protocol, self.options, self.path, self.size = protocol, options, path, size
        self.version = version

    @staticmethod
    def block_bytes_of(block_bytes: int) -> int:
        """The bytes of each block of a file read in blocks of about `block_bytes`."""
        return max(ROW_BYTES, block_bytes // ROW_BYTES * ROW_BYTES)

    @property
    def block_bytes(self) -> int:
        return self.info.block_len * ROW_BYTES

    def reader(self, k: int) -> FileBlockReader:
        start, stop = self.info.block_range(k)
        first, last = start * ROW_BYTES, min(self.size, stop * ROW_BYTES)
        return FileBlockReader(self.info.url, self.protocol, self.options, self.path, first, last,
                               self.info.identity, k, start, stop, self.version)


class FileBlockReader(StoreReader):
    """Reads bytes first..last-1 of one file (one ranged read) as rows of ROW_BYTES."""

    def __init__(self, url, protocol, options, path, first, last, identity, index, start, stop, version=None):
        super().__init__(url, identity, index, start, stop, (last - first) + 8 * (stop - start))
        self.protocol, self.options, self.path, self.first, self.last = protocol, options, path, first, last
        self.version = version  # [[field, value], ...] of the file's info (`dmdask.fs.metadata.version_of`)

    def __dask_tokenize__(self):
        # the same block submitted by several processes is the same task
        return ("dmdask-file-block", self.key, self.url, self.options, self.first, self.last)

    def _read(self) -> dict:
        return self.decode(self.read_bytes(filesystem(self.protocol, self.options)))

    def read_bytes(self, fs) -> bytes:
        """The block's bytes of the version the dataset was opened at; `FileChanged` if the
        store now holds another (so a read never mixes blocks of two versions)."""
        with self._refused_as_changed():
            content = fs.cat_file(self.path, start=self.first, end=self.last,
                                  **_precondition(self.protocol, self.version))
        self._check_local_version()
        return content

    async def read_bytes_async(self, fs) -> bytes:
        """`read_bytes` on an async filesystem's loop (`_cat_file` is fsspec's documented async API)."""
        with self._refused_as_changed():
            return await fs._cat_file(self.path, start=self.first, end=self.last,
                                      **_precondition(self.protocol, self.version))

    @contextlib.contextmanager
    def _refused_as_changed(self):
        """`FileChanged` for a read the store refused as of another version (HTTP 412)."""
        try:
            yield
        except Exception as exc:
            if getattr(exc, "status", None) == 412:
                raise self._changed() from exc
            raise

    def _check_local_version(self) -> None:
        fields = dict(self.version or ())
        if self.protocol in ("file", "local") and "mtime" in fields:
            try:
                now = os.stat(self.path).st_mtime
            except FileNotFoundError:
                raise self._changed() from None
            if str(now) != fields["mtime"] and repr(now) != fields["mtime"]:
                raise self._changed()

    def _changed(self) -> FileChanged:
        return FileChanged(f"{self.url} changed while it was being read (it is no longer the version "
                           f"{dict(self.version or ())} it was opened at); read it again to get the new version")

    def decode(self, content: bytes) -> dict:
        """The block's rows from its bytes as the store gave them."""
        if len(content) != self.last - self.first:
            raise OSError(f"the store gave {len(content)} bytes for bytes {self.first}..{self.last - 1} of "
                          f"{self.url}: the file changed since it was opened")
        flat = np.frombuffer(content, dtype=np.uint8)
        rows = np.empty(self.stop - self.start, dtype=object)
        for i in range(len(rows)):
            rows[i] = flat[i * ROW_BYTES:(i + 1) * ROW_BYTES]
        return {"data": rows}
