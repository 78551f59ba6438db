"""URLs in one spelling (`normalize`), without credentials (`public`), the URLs a list
source names (`listed_urls`), and the sources workers may read (`check_source`,
docs/failures.md#trust-model)."""
from __future__ import annotations

import os
import posixpath
import re
import urllib.parse

import dask.config

from ..errors import SourceNotAllowedError, SpecError

LOCAL_PROTOCOLS = ("file://", "local://")


def listed_urls(source) -> list[str] | None:
    """The URLs that a `Spec.source` names one by one (a tuple, a brace pattern, a URL ending
    in `.tar`), or None for a source named by one URL."""
    if isinstance(source, tuple):
        return list(source)
    if "{" in source:
        from braceexpand import UnbalancedBracesError, braceexpand

        try:
            expanded = list(braceexpand(source))
        except UnbalancedBracesError as exc:
            raise SpecError("source", f"a valid brace pattern ({exc})", source) from None
        if expanded != [source]:
            return expanded
    return [source] if source.rstrip("/").endswith(".tar") else None


def normalize(url: str) -> str:
    """One spelling of a URL: a local path or `file://` URL as an absolute path without `.` or
    `..`; any other URL with its path normalised the same way; of a chain, the last URL."""
    url = url.rsplit("::", 1)[-1]
    if url.startswith(LOCAL_PROTOCOLS):
        url = url.split("://", 1)[1]
    if "://" not in url:
        return os.path.abspath(url)
    protocol, rest = url.split("://", 1)
    path = posixpath.normpath(rest) if rest else rest
    return f"{protocol}://{path}"


def resolve_local(source: str) -> str:
    """A local path as an absolute one, in this process's working directory; URLs as they are."""
    if "://" in source or "::" in source:
        return source
    return os.path.abspath(source)


def public(url: str) -> str:
    """`url` without what may be a credential: its user and password, and its query string."""
    parts = url.split("::")
    for i, part in enumerate(parts):
        if "://" in part:
            protocol, rest = part.split("://", 1)
            host, slash, path = rest.partition("/")
            host = host.rsplit("@", 1)[-1]
            parts[i] = f"{protocol}://{host}{slash}{path.split('?', 1)[0]}"
    return "::".join(parts)


ENCODED_SEPARATORS = re.compile(r"%(2e|2f|5c)", re.IGNORECASE)  # ".", "/", "\\" percent-encoded


def opened(url: str) -> str:
    """What a filesystem opens for `url` (of a chain, the last URL), in one spelling: a local
    path as fsspec takes it (`~` expanded), then with every symbolic link resolved
    (`realpath`); any other URL as `protocol://host/path`, the path without `.` and `..`,
    without query, fragment or credentials. `SourceNotAllowedError` for a percent-encoded
    `.`, `/` or `\\` in a URL's path, which a store may decode into a way out of a folder."""
    last = url.rsplit("::", 1)[-1]
    if last.startswith(LOCAL_PROTOCOLS) or "://" not in last:
        path = last.split("://", 1)[1] if "://" in last else last
        return os.path.realpath(os.path.expanduser(path))
    parts = urllib.parse.urlsplit(last)
    if ENCODED_SEPARATORS.search(parts.path):
        raise SourceNotAllowedError(f"{public(url)}: a percent-encoded '.', '/' or '\\' in a source's path is "
                                    "refused by dmdask.worker.allowed-sources (write the path plainly)")
    path = posixpath.normpath(parts.path) if parts.path else ""
    return f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{path}"


def check_source(url: str) -> None:
    """Nothing when this process's `dmdask.worker.allowed-sources` (URL prefixes; empty, the
    default: any source) lets workers read `url`; `SourceNotAllowedError` naming it and the
    prefixes otherwise. What is compared is what the filesystem opens (`opened`, for the
    URL and the prefixes alike): a prefix matches whole path components (`/data` allows
    `/data/x`, not `/database`), so neither `..` (plain or percent-encoded), a query or
    fragment, `~`, nor a symbolic link in an allowed folder leads out of it."""
    prefixes = dask.config.get("dmdask.worker.allowed-sources", None) or []
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    if not all(isinstance(p, str) and p for p in prefixes):
        raise SpecError("dmdask.worker.allowed-sources", "a list of URL prefixes (empty: any source)", prefixes)
    if not prefixes:
        return
    prefixes = [opened(p) for p in prefixes]
    normal = opened(url)
    if not any(normal == p or normal.startswith(p.rstrip("/") + "/") for p in prefixes):
        raise SourceNotAllowedError(f"{public(url)} is outside the sources this cluster's workers read: {prefixes} "
                                    "(dmdask.worker.allowed-sources in the workers' dask config)")
