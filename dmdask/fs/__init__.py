"""Transparent mode: the `dmdask::` fsspec protocol (also spelt `dmdask://`, for webdataset),
so unmodified loaders read through the cluster's tiered cache.

`DmdaskFileSystem` is a read-only filesystem chained over any other (its target). A file
read through it is a dataset of the cluster's registry (`dmdask.source.files`): byte blocks
of `dmdask.fs.block-size`, each loaded by its planned worker when any process first reads a
byte of it. Guarantees, the cluster it finds and limits: docs/transparent.md.
"""
from __future__ import annotations

import dask.config
import fsspec
from dask.utils import parse_bytes
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from ..errors import NoClusterError
from ..internals import strip_protocol
from ..source.base import options_json, protocol_of
from ..source.files import FileSource
from . import globbing, probe
from .metadata import settled, version_of
from .session import close, get_session

try:  # fsspec >= 2025.x: the marker that makes `url_to_fs` hand the inner path over
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = AbstractFileSystem

PROTOCOL = "dmdask"
CACHED_BLOCKS = 2  # blocks an open file keeps (so small reads in one block cost one fetch)

__all__ = ["PROTOCOL", "DmdaskFile", "DmdaskFileSystem", "NoClusterError", "close", "gopen"]


class DmdaskFileSystem(_Base):
    """A read-only filesystem over `target_protocol` (or `fs`) whose reads go through
    the dmdask cluster at `scheduler`. block_size: default `dmdask.fs.block-size`.
    `target_options` travel to the workers: plain values (JSON) only."""

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, target_protocol=None, target_options=None, fs=None, scheduler=None, block_size=None,
                 fo=None, **kwargs):
        kwargs.pop("asynchronous", None)  # zarr asks for an async filesystem; it wraps this one
        super().__init__(**kwargs)
        if fs is None:
            fs = fsspec.filesystem(target_protocol or "file", **(target_options or {}))
            options = dict(target_options or {})
        else:
            options = dict(fs.storage_options)
        self.fs = fs
        self.target_protocol = protocol_of(fs)
        self.target_options = options
        self.scheduler = scheduler
        self.block_bytes = int(parse_bytes(block_size or dask.config.get("dmdask.fs.block-size")))
        self._options = options_json(options)
        self.target_id = f"{self.target_protocol}|{self._options}"  # the target filesystem, as the session keys it

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        for prefix in (f"{PROTOCOL}::", f"{PROTOCOL}://"):
            path = path.removeprefix(prefix)
        return path

    @staticmethod
    def _get_kwargs_from_urls(path):
        """`dmdask://https://host/x` (one URL, no "::": what webdataset keeps whole) names
        its target protocol itself."""
        inner = path[len(PROTOCOL) + 3:] if path.startswith(f"{PROTOCOL}://") else ""
        protocol = fsspec.core.split_protocol(inner)[0] if "://" in inner else None
        return {"target_protocol": protocol} if protocol else {}

    def target_path(self, path: str) -> str:
        return strip_protocol(self.fs, self._strip_protocol(path))

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}::{self.fs.unstrip_protocol(name)}"

    def _session(self):
        return get_session(self.scheduler)

    def ls(self, path, detail=True, **kwargs):
        entries = self._session().metadata.ls(self.target_id, self.fs, self.target_path(path))
        return [dict(e) for e in entries] if detail else [e["name"] for e in entries]

    def info(self, path, **kwargs):
        return dict(self._session().metadata.info(self.target_id, self.fs, self.target_path(path)))

    def open_info(self, path) -> dict:
        """`info` of a file about to be read from its start: on HTTP from the ranged GET of
        its first block, whose bytes the read that follows takes (`dmdask.fs.probe`)."""
        return self._file(path, 0)[0]

    def glob(self, path, maxdepth=None, **kwargs):
        """As the target's `glob` answers (`dmdask.fs.globbing`), over this run's listings."""
        return globbing.glob(self, path, maxdepth=maxdepth, url_rules=probe.applies(self.fs), **kwargs)

    def isdir(self, path) -> bool:
        return self.fs.isdir(self.target_path(path))

    def invalidate_cache(self, path=None):
        """Forget every listing and info this process knows: a new run, which asks the store again."""
        self._session().forget()
        super().invalidate_cache(path)

    def source(self, path: str, info: dict) -> FileSource:
        """The dataset of file `path` (target naming) as `info` describes it (a local file's
        info settled first: `settled`)."""
        if self.target_protocol in ("file", "local"):
            info = settled(self.fs, path, info)
        url = self.fs.unstrip_protocol(path)
        return FileSource(url, self.target_protocol, self._options, path, int(info["size"]), version_of(info),
                          self.block_bytes)

    def _file(self, path: str, start: int | None = 0):
        """(info, source) of a file about to be read from byte `start` (None: from its
        end); source is None when it is empty or its size unknown."""
        info = dict(self._session().claims.first_info(self, self.target_path(path), start))
        if info.get("type", "file") != "file":
            raise IsADirectoryError(path)
        size = info.get("size")
        return info, (self.source(self.target_path(path), info) if size else None)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if mode != "rb":
            raise PermissionError(f"{PROTOCOL}:: is read-only; cannot open {path!r} with mode {mode!r}")
        info, source = self._file(path)
        if source is None and info.get("size") is None:  # no size to cut blocks by: read the store directly
            return self.fs.open(self.target_path(path), "rb", **kwargs)
        return DmdaskFile(self, self.target_path(path), source, cache_options=cache_options, **kwargs)

    def _range(self, path, start, end):
        """(source, start, stop) to read through the cluster, or the bytes themselves for a
        file that is empty or of unknown size (read from the store directly)."""
        info, source = self._file(path, 0 if start is None else start)
        if source is None:
            return b"" if info.get("size") == 0 else self.fs.cat_file(self.target_path(path), start=start, end=end)
        start, end, _ = slice(start, end).indices(source.size)  # negative from the end, clamped to the file
        return source, start, end

    def cat_file(self, path, start=None, end=None, **kwargs):
        found = self._range(path, start, end)
        return found if isinstance(found, bytes) else self._session().blocks.read_ranges(self, [found])[0]

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        """Several ranges in one go: one scheduler request for the blocks new to this
        process, the store read concurrently for those it is first to read."""
        n = len(paths)
        starts = starts if isinstance(starts, list) else [starts] * n
        ends = ends if isinstance(ends, list) else [ends] * n
        self._session().metadata.learn_infos(self, [self.target_path(p) for p in paths])  # at once, not one by one
        out, ranges, where = [None] * n, [], []
        for i, (path, start, end) in enumerate(zip(paths, starts, ends)):
            try:
                found = self._range(path, start, end)
            except Exception as exc:
                if on_error == "raise":
                    raise
                out[i] = exc
                continue
            if isinstance(found, bytes):
                out[i] = found
            else:
                ranges.append(found)
                where.append(i)
        try:
            for i, data in zip(where, self._session().blocks.read_ranges(self, ranges)):
                out[i] = data
        except Exception:
            if on_error == "raise" or len(ranges) == 1:
                raise
            for i in where:  # one range failed: each on its own, so the others still come back
                try:
                    out[i] = self.cat_file(paths[i], starts[i], ends[i])
                except Exception as exc:
                    out[i] = exc
        return out

    def cat(self, path, recursive=False, on_error="raise", **kwargs):
        """Like fsspec's `cat`; many files are read in one go (`cat_ranges`)."""
        paths = self.expand_path(path, recursive=recursive)
        if len(paths) == 1 and not isinstance(path, list) and paths[0] == self._strip_protocol(path):
            return self.cat_file(paths[0])
        contents = self.cat_ranges(paths, None, None, on_error="raise" if on_error == "raise" else "return")
        return {p: c for p, c in zip(paths, contents) if not (on_error == "omit" and isinstance(c, Exception))}

    def _read_only(self, *args, **kwargs):
        raise PermissionError(f"{PROTOCOL}:: is read-only")

    _rm = mkdir = cp_file = _read_only


class DmdaskFile(AbstractBufferedFile):
    """A file read through the cluster, a whole cached block at a time (the last
    `CACHED_BLOCKS` blocks kept), so sequential and nearby reads cost one fetch per block."""

    def __init__(self, fs: DmdaskFileSystem, path: str, source, cache_options=None, **kwargs):
        kwargs.pop("cache_type", None)
        self.source = source
        block = source.block_bytes if source is not None else fs.block_bytes
        super().__init__(fs, path, mode="rb", block_size=block, cache_type="blockcache",
                         cache_options={"maxblocks": CACHED_BLOCKS, **(cache_options or {})},
                         size=source.size if source is not None else 0, **kwargs)

    def _fetch_range(self, start, end):
        return self.fs._session().blocks.read_ranges(self.fs, [(self.source, start, min(end, self.size))])[0]


def gopen(url, mode="rb", bufsize=8192, **kwargs):
    """webdataset's opener for `dmdask::` URLs (in `webdataset.gopen.gopen_schemes` once `dmdask` is imported)."""
    return fsspec.open(url, mode).open()
