"""Transparent mode: the `dmdask::` fsspec protocol (also spelt `dmdask://URL`), so
unmodified loaders read through the cluster's tiered cache.

`DmdaskFileSystem` is a read-only filesystem chained over any other (its target). A file
read through it is a dataset of the cluster's registry (`dmdask.source.files`): byte blocks
of `dmdask.fs.block-size`, each loaded by its planned worker when any process first reads a
byte of it. Every name it answers (`ls`, `find`, `walk`, `glob`, `info`, `unstrip_protocol`)
is `dmdask://` and the target's full URL, so a reader that opens what it listed stays in
the cache. Guarantees, the cluster it finds and limits: docs/transparent.md.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os

import dask.config
import fsspec
from dask.utils import parse_bytes
from fsspec.callbacks import DEFAULT_CALLBACK
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem
from fsspec.utils import isfilelike

from ..errors import NoClusterError
from ..internals import strip_protocol
from ..source.base import options_json, protocol_of
from ..source.files import FileSource
from . import globbing, probe
from .metadata import modified_of, settled, version_of
from .session import close, get_session

try:  # fsspec >= 2025.x: the marker that makes `url_to_fs` hand the inner path over
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = AbstractFileSystem

PROTOCOL = "dmdask"
CACHED_BLOCKS = 2  # blocks an open file keeps (so small reads in one block cost one fetch)

__all__ = ["PROTOCOL", "DmdaskFile", "DmdaskFileSystem", "NoClusterError", "close", "gopen"]


def routed(method):
    """`method`, answered by the filesystem `routed_to` names for its path, if any."""
    @functools.wraps(method)
    def call(self, path, *args, **kwargs):
        other = self.routed_to(path)
        if other is not None:
            return getattr(other, method.__name__)(path, *args, **kwargs)
        return method(self, path, *args, **kwargs)
    return call


class DmdaskFileSystem(_Base):
    """A read-only filesystem over `target_protocol` (or `fs`) whose reads go through
    the dmdask cluster at `scheduler`. block_size: default `dmdask.fs.block-size`.
    `target_options` travel to the workers: plain values (JSON) only. Made with neither
    target_protocol nor fs (`fsspec.filesystem("dmdask")`, as DuckDB's `register_filesystem`
    takes it), it reads local paths and any URL through the target that URL names."""

    protocol = PROTOCOL
    root_marker = ""
    cachable = False  # an instance is cheap; a cached one could outlive the cluster and the target it was made for

    def __init__(self, target_protocol=None, target_options=None, fs=None, scheduler=None, block_size=None,
                 fo=None, **kwargs):
        kwargs.pop("asynchronous", None)  # zarr asks for an async filesystem; it wraps this one
        self.any_target = fs is None and target_protocol is None  # URLs of other protocols: `routed_to`
        if fs is None and target_protocol == PROTOCOL:  # `dmdask::dmdask://URL` (a listed name chained again)
            inner = dict(target_options or {})
            target_protocol, target_options = inner.pop("target_protocol", None), inner.pop("target_options", None)
            scheduler = scheduler or inner.get("scheduler")
            block_size = block_size or inner.get("block_size")
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
        self.block_size = block_size
        self.block_bytes = int(parse_bytes(block_size or dask.config.get("dmdask.fs.block-size")))
        self._options = options_json(options)
        self.target_id = f"{self.target_protocol}|{self._options}"  # the target filesystem, as the session keys it
        self.target_named = TargetNamed(self)

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

    def routed_to(self, path) -> DmdaskFileSystem | None:
        """For a filesystem made without a target: the one over the target that URL `path`
        (the first of a list) names, when that is not this one's; else None."""
        if not self.any_target:
            return None
        first = path[0] if isinstance(path, (list, tuple)) and path else path
        inner = self._strip_protocol(first)
        protocol = inner.split("://", 1)[0] if "://" in inner else None
        targets = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        if protocol is None or protocol in targets:
            return None
        return type(self)(target_protocol=protocol, scheduler=self.scheduler, block_size=self.block_size)

    def target_path(self, path: str) -> str:
        """`path` (any spelling: `dmdask://URL`, `dmdask::URL`, the target's own) as the target names it.
        A URL of another protocol than the target's raises ValueError naming the fix."""
        path = self._strip_protocol(path)
        protocol = path.split("://", 1)[0] if "://" in path else None
        targets = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
        if protocol is not None and protocol not in targets:
            raise ValueError(
                f"{PROTOCOL}: {path!r} is a {protocol}:// URL, but this filesystem reads through {targets[0]}://: "
                f"make it with fsspec.filesystem({PROTOCOL!r}, target_protocol={protocol!r}) (or open the URL "
                f"{PROTOCOL}://{path} with fsspec.open / fsspec.core.url_to_fs, which take the target from it)")
        return strip_protocol(self.fs, path)

    @routed
    def unstrip_protocol(self, name: str) -> str:
        """The name of `name` (a path in any spelling) here: `dmdask://` and the target's full URL."""
        name = fsspec.utils.stringify_path(name)
        if name.startswith(f"{PROTOCOL}://"):
            return name
        return f"{PROTOCOL}://{self.fs.unstrip_protocol(self._strip_protocol(name))}"

    def _named(self, entry: dict) -> dict:
        return dict(entry, name=self.unstrip_protocol(entry["name"]))

    def _session(self):
        return get_session(self.scheduler)

    @routed
    def ls(self, path, detail=True, **kwargs):
        entries = self.target_named.ls(path)
        return [self._named(e) for e in entries] if detail else [self.unstrip_protocol(e["name"]) for e in entries]

    @routed
    def info(self, path, **kwargs):
        return self._named(self.target_named.info(path))

    @routed
    def walk(self, path, maxdepth=None, topdown=True, on_error="omit", **kwargs):
        """fsspec's `walk`, each folder named `dmdask://URL` (its entries' names too)."""
        detail = kwargs.get("detail", False)
        for folder, dirs, files in self.target_named.walk(path, maxdepth, topdown, on_error, **kwargs):
            if detail:
                dirs = {k: self._named(v) for k, v in dirs.items()}
                files = {k: self._named(v) for k, v in files.items()}
            yield self.unstrip_protocol(folder), dirs, files

    @routed
    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        found = self.target_named.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=True, **kwargs)
        named = {self.unstrip_protocol(p): self._named(info) if info else info for p, info in found.items()}
        return named if detail else list(named)

    @routed
    def expand_path(self, path, recursive=False, maxdepth=None, **kwargs):
        return [self.unstrip_protocol(p) for p in super().expand_path(path, recursive, maxdepth, **kwargs)]

    @routed
    def open_info(self, path, ahead=(), most: int = 0) -> dict:
        """`info` of a file about to be read from its start: on HTTP from the ranged GET of
        its first block, whose bytes the read that follows takes (`dmdask.fs.probe`).
        `ahead`: other files of this target likely read soon (the mount passes a folder's):
        the first `most` of them new to the run are claimed with it, in one scheduler request,
        and their first blocks read concurrently in the background, so that their own
        `open_info` finds them read."""
        return self._named(self._file(path, 0, (self.target_path(p) for p in ahead), most)[0])

    @routed
    def glob(self, path, maxdepth=None, **kwargs):
        """As the target's `glob` answers (`dmdask.fs.globbing`), over this run's listings."""
        found = globbing.glob(self.target_named, path, maxdepth=maxdepth, url_rules=probe.applies(self.fs), **kwargs)
        if isinstance(found, dict):
            return {self.unstrip_protocol(p): self._named(info) for p, info in found.items()}
        return [self.unstrip_protocol(p) for p in found]

    @routed
    def isdir(self, path) -> bool:
        """From the run's listings and infos where they tell (an HTTP target's own `isdir`
        GETs the whole URL, so there only a listing of its folder tells), else the target's."""
        target = self.target_path(path)
        if not probe.applies(self.fs):
            try:
                return self.target_named.info(target).get("type") == "directory"
            except FileNotFoundError:
                return False
        entry = self._session().metadata.listed(self.target_id, target)
        return entry.get("type") == "directory" if entry is not None else self.fs.isdir(target)

    @routed
    def get_file(self, rpath, lpath, callback=DEFAULT_CALLBACK, outfile=None, **kwargs):
        """Copy file `rpath` to local `lpath` (or into file object `outfile`) through the
        cache. A folder makes a local folder, as fsspec's `get_file` does, except on HTTP,
        whose own `get_file` takes any URL as a file (asking `isdir` there GETs the file)."""
        if outfile is None and isfilelike(lpath):
            outfile = lpath
        if outfile is None and not probe.applies(self.fs) and self.isdir(rpath):
            os.makedirs(lpath, exist_ok=True)
            return
        with self.open(rpath, "rb") as source:
            callback.set_size(source.size)
            with contextlib.ExitStack() as closing:
                if outfile is None:
                    os.makedirs(os.path.dirname(os.path.abspath(lpath)), exist_ok=True)
                    outfile = closing.enter_context(open(lpath, "wb"))
                for chunk in iter(lambda: source.read(self.blocksize), b""):
                    outfile.write(chunk)
                    callback.relative_update(len(chunk))

    @routed
    def modified(self, path) -> datetime.datetime:
        """The file's modification time, from the info the run read (the target's own
        `modified` where its info has none, as on HTTP without Last-Modified)."""
        found = modified_of(self.target_named.info(path))
        return found if found is not None else self.fs.modified(self.target_path(path))

    @routed
    def created(self, path) -> datetime.datetime:
        return self.fs.created(self.target_path(path))

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

    def _file(self, path: str, start: int | None = 0, ahead=(), most: int = 0):
        """(info, source) of a file about to be read from byte `start` (None: from its
        end); source is None when it is empty or its size unknown. `ahead`: `open_info`'s."""
        info = dict(self._session().claims.first_info(self, self.target_path(path), start, ahead, most))
        if info.get("type", "file") != "file":
            raise IsADirectoryError(path)
        size = info.get("size")
        return info, (self.source(self.target_path(path), info) if size else None)

    @routed
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

    @routed
    def cat_file(self, path, start=None, end=None, **kwargs):
        found = self._range(path, start, end)
        return found if isinstance(found, bytes) else self._session().blocks.read_ranges(self, [found])[0]

    @routed
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

    @routed
    def cat(self, path, recursive=False, on_error="raise", **kwargs):
        """Like fsspec's `cat`; many files are read in one go (`cat_ranges`). Several files
        come keyed in the caller's spelling: `dmdask://URL` names for `dmdask://` paths, the
        target's paths for paths the target names (a `dmdask::` chain passes those), as
        fsspec's own filesystems key them by the paths they were given."""
        paths = self.expand_path(path, recursive=recursive)
        if len(paths) == 1 and not isinstance(path, list) and paths[0] == self.unstrip_protocol(path):
            return self.cat_file(paths[0])
        contents = self.cat_ranges(paths, None, None, on_error="raise" if on_error == "raise" else "return")
        asked = path if isinstance(path, (list, tuple)) else [path]
        named = all(fsspec.utils.stringify_path(p).startswith(f"{PROTOCOL}://") for p in asked)
        keys = paths if named else [self.target_path(p) for p in paths]
        return {k: c for k, c in zip(keys, contents) if not (on_error == "omit" and isinstance(c, Exception))}

    def _read_only(self, *args, **kwargs):
        raise PermissionError(f"{PROTOCOL}:: is read-only")

    _rm = mkdir = cp_file = _read_only


class TargetNamed(AbstractFileSystem):
    """A `DmdaskFileSystem`'s listings and infos in its target's naming: what fsspec's
    generic `walk`, `find` and dmdask's `glob` run over (the filesystem then names
    their answers `dmdask://URL`)."""

    cachable = False

    def __init__(self, owner: DmdaskFileSystem):
        super().__init__()
        self.owner = owner

    def _strip_protocol(self, path):  # an instance's: the owner's target strips
        return self.owner.target_path(path)

    def target_path(self, path: str) -> str:
        return self.owner.target_path(path)

    def ls(self, path, detail=True, **kwargs):
        owner = self.owner
        entries = owner._session().metadata.ls(owner.target_id, owner.fs, owner.target_path(path))
        return [dict(e) for e in entries] if detail else [e["name"] for e in entries]

    def info(self, path, **kwargs):
        owner = self.owner
        return dict(owner._session().metadata.info(owner.target_id, owner.fs, owner.target_path(path)))

    def isdir(self, path) -> bool:
        return self.owner.isdir(path)


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
