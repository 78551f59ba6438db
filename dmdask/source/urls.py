"""URLs in one spelling (`normalize`), without credentials (`public`), the URLs a list
source names (`listed_urls`), and the sources workers may read (`check_source`,
docs/failures.md#trust-model)."""
from __future__ import annotations

import os
import posixpath

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


def check_source(url: str) -> None:
    """Nothing when this process's `dmdask.worker.allowed-sources` (URL prefixes; empty, the
    default: any source) lets workers read `url`; `SourceNotAllowedError` naming it and the
    prefixes otherwise. A prefix matches whole path components (`/data` allows `/data/x`, not
    `/database`), both normalised, so `..` cannot climb out of an allowed folder."""
    prefixes = dask.config.get("dmdask.worker.allowed-sources", None) or []
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    if not all(isinstance(p, str) and p for p in prefixes):
        raise SpecError("dmdask.worker.allowed-sources", "a list of URL prefixes (empty: any source)", prefixes)
    prefixes = [normalize(p) for p in prefixes]
    if not prefixes:
        return
    normal = normalize(url)
    if not any(normal == p or normal.startswith(p.rstrip("/") + "/") for p in prefixes):
        raise SourceNotAllowedError(f"{url} is outside the sources this cluster's workers read: {prefixes} "
                                    "(dmdask.worker.allowed-sources in the workers' dask config)")
