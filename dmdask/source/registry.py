"""Source formats, and the first one that claims a spec's source (`find`).

Formats that other packages declare under the entry point group `dmdask.sources` are
asked first, by name; then dmdask's own (`BUILTIN`, listed here so that a source tree
works uninstalled), in the order that reads least before deciding.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

import fsspec
import fsspec.utils
from dask.base import tokenize

from ..errors import SourceNotFoundError, SpecError
from .base import Source, bound_identity, read_options
from .urls import listed_urls

GROUP = "dmdask.sources"
# modules of dmdask.source, each with FORMAT; "megatron" before those that claim any file or folder
BUILTIN = ("tokens", "zarr", "hdf5", "megatron", "parquet", "webdataset", "folder")
LAYOUTS = ("a Zarr v3 group or array, a Parquet file, folder of Parquet files or glob, an HDF5 file "
           "(or a group in it: file.h5/group), a Megatron indexed dataset (.bin + .idx), WebDataset .tar shards, "
           "a folder of class subfolders, a list of sample files, or dmdask.Tokens(path, dtype) for a raw file of "
           "token ids")


@dataclasses.dataclass(frozen=True)
class Format:
    """A source layout: `claims(place)` says, with as few reads as it can, whether `place`
    holds it; `open(place)` opens it, raising `SourceError` (or a subclass) if it cannot.
    Its `DatasetInfo` is named `place.name` with the identity `place.identity(...)` of what
    its blocks read (the scheduler refuses any other: `DatasetInfo.bound`)."""

    name: str
    claims: Callable[[Place], bool]
    open: Callable[[Place], Source]


class Place:
    """A spec's source. Named one by one (a list, a brace pattern, a `.tar` URL): `urls`, and
    either `shards` (all of them `.tar`) or `files` (none of them), the other None; `url`
    and `fs` None. Else `url` on the filesystem `fs` at `path` (`SpecError` for a URL fsspec
    cannot open), `urls` None; `tokens` the source when it is a `dmdask.Tokens` (its dtype),
    else None. Each fact read from the store (`exists`, `head`, `listing`) is read once,
    when first asked."""

    def __init__(self, spec, name: str):
        self.spec, self.name, self.options = spec, name, dict(spec.storage_options or {})
        self.tokens = spec.source if is_tokens(spec.source) else None
        self.urls = None if self.tokens is not None else listed_urls(spec.source)
        self.shards = self.files = None
        self.url, self.fs, self.path = None, None, ""
        if self.urls is not None:
            tars = [u.rstrip("/").endswith(".tar") for u in self.urls]
            if any(tars) and not all(tars):
                raise SpecError("source", "a list of WebDataset .tar shards, or of sample files (one file per "
                                "sample), not both", spec.source)
            self.shards, self.files = (self.urls, None) if all(tars) else (None, self.urls)
        else:
            self.url = (spec.source.path if self.tokens is not None else spec.source).rstrip("/")
            try:
                self.fs, self.path = fsspec.core.url_to_fs(
                    self.url, **read_options(fsspec.utils.get_protocol(self.url), self.options))
            except (ImportError, ValueError) as exc:
                raise SpecError("source", f"a URL fsspec can open ({exc})", spec.source) from None

    def identity(self, *described) -> str:
        """The identity of the dataset opened here, bound to its registry name (`bound_identity`):
        `described` is what the blocks read (the URL, the layout, sizes or versions), tokenized."""
        return bound_identity(self.name, tokenize(*described)[:16])

    def listed_paths(self, what: str) -> tuple:
        """(filesystem, paths) of `urls`; `SpecError` unless fsspec opens them all with one
        protocol. `what`: what the URLs are, for the message. URLs of one protocol, none
        chained (`::`), are stripped one by one (1.7 us a URL, measured on 100,000 HTTP
        URLs); others go through fsspec's `get_fs_token_paths` (7.6 us a URL)."""
        urls, options = self.urls, dict(self.options)
        try:
            if len({fsspec.utils.get_protocol(u) for u in urls}) == 1 and not any("::" in u for u in urls):
                fs, _ = fsspec.core.url_to_fs(urls[0], **read_options(fsspec.utils.get_protocol(urls[0]), options))
                return fs, [fsspec.core.strip_protocol(u) for u in urls]
            fs, _, paths = fsspec.core.get_fs_token_paths(urls, storage_options=options)
        except (ImportError, ValueError) as exc:
            reason = "they are on several filesystems" if "mismatch" in str(exc) else str(exc)
            raise SpecError("source", f"{what} URLs fsspec can open, on one filesystem (one protocol): {reason}",
                            self.spec.source) from None
        return fs, paths

    def label(self, what: str) -> str:
        """How the source is named in messages and `DatasetInfo.url`."""
        if self.urls is None:
            return self.url
        if isinstance(self.spec.source, str):
            return self.spec.source
        return self.urls[0] if len(self.urls) == 1 else f"{self.urls[0]} and {len(self.urls) - 1} more {what}"

    @functools.cached_property
    def exists(self) -> bool:
        """Whether the URL names a file or folder (False for a listed source)."""
        return self.urls is None and self.has(self.path)

    @property
    def is_glob(self) -> bool:
        return self.urls is None and not self.exists and any(c in self.path for c in "*?[")

    @functools.cached_property
    def head(self) -> bytes:
        """The first 8 bytes of the file (one small range read); b"" for a folder."""
        try:
            return self.fs.cat_file(self.path, start=0, end=8) if self.exists else b""
        except (IsADirectoryError, FileNotFoundError):
            return b""

    @functools.cached_property
    def listing(self) -> list:
        """`fs.ls(path, detail=True)` where the URL exists; [] otherwise."""
        try:
            return self.fs.ls(self.path, detail=True) if self.exists else []
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise SourceNotFoundError(f"dataset {self.url} is none of {LAYOUTS}: {exc}") from exc

    def has(self, path: str) -> bool:
        """Whether `path` exists, asked with `info` (over HTTP a HEAD; `exists` would GET the file)."""
        try:
            self.fs.info(path)
            return True
        except FileNotFoundError:
            return False
        except Exception as exc:  # network errors, permissions
            raise SourceNotFoundError(f"cannot reach dataset {self.url}: {exc}") from exc


def is_tokens(source) -> bool:
    """Whether a `Spec.source` is a `dmdask.Tokens` (imported here, where it is asked: the
    spec's module imports this package)."""
    from ..spec import Tokens

    return isinstance(source, Tokens)


LISTED = ("webdataset", "folder")  # the built-in formats that claim a list of URLs (the others never do)


@functools.cache
def installed() -> list[Format]:
    """Installed packages' formats (entry points), by name."""
    return [ep.load() for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name)]


@functools.cache
def builtin(module: str) -> Format:
    return importlib.import_module(f"{__package__}.{module}").FORMAT


def formats() -> list[Format]:
    """The formats in the order they are asked: installed packages' first, then dmdask's."""
    return installed() + [builtin(module) for module in BUILTIN]


def find(place: Place) -> Format | None:
    """The first format that claims `place`; None if none does. A list of URLs asks only the
    built-in formats that claim lists, so a rank opening one imports no other (3 of the 13
    ms of a process's first open of 1,024 URLs, measured alone)."""
    candidates = formats() if place.urls is None else installed() + [builtin(m) for m in LISTED]
    return next((f for f in candidates if f.claims(place)), None)
