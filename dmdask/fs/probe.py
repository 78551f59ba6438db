"""A file's info and its first bytes from one ranged GET, for stores whose listings give
no sizes (HTTP): a first read costs one store round trip, not a HEAD and a GET.

Guarantee: the info `first_block` returns has the fields fsspec's own HTTP `info` gives
for the same file (so both name the same blocks), or it returns None.
"""
from __future__ import annotations

import asyncio
import concurrent.futures

import fsspec.asyn

try:
    from fsspec.implementations.http import HTTPFileSystem
except ImportError:  # pragma: no cover - no aiohttp
    HTTPFileSystem = None

VERSION_HEADERS = ("ETag", "Content-MD5", "Digest", "Last-Modified")  # what fsspec's HTTP info keeps


def applies(target) -> bool:
    """Whether `target` is a store whose files' infos each cost a request (HTTP)."""
    return HTTPFileSystem is not None and isinstance(target, HTTPFileSystem)


def first_block(target, url: str, first: int, nbytes: int) -> tuple[dict, bytes] | None:
    """(info, the file's bytes first..first+nbytes-1, fewer at its end, none past it)
    from one ranged GET of `url` on HTTP filesystem `target`; None when the answer does
    not say the size (the caller then reads the info the usual way). A missing file
    raises FileNotFoundError."""
    return fsspec.asyn.sync(target.loop, _first_block, target, url, first, nbytes)


def start_first_block(target, url: str, first: int, nbytes: int) -> concurrent.futures.Future:
    """`first_block`, started on `target`'s event loop and not waited for: its future."""
    return asyncio.run_coroutine_threadsafe(_first_block(target, url, first, nbytes), target.loop)


async def _first_block(target, url: str, first: int, nbytes: int):
    session = await target.set_session()
    kwargs = dict(target.kwargs)
    headers = dict(kwargs.pop("headers", None) or {}, Range=f"bytes={first}-{first + nbytes - 1}",
                   **{"Accept-Encoding": "identity"})
    async with session.get(target.encode_url(url), headers=headers, **kwargs) as r:
        if r.status == 404:
            raise FileNotFoundError(url)
        if r.status == 416:  # an empty file, or `first` past the end
            size = _total(r.headers.get("Content-Range", ""))
            return (_info(url, r, size), b"") if size is not None else None
        if r.status not in (200, 206) or r.headers.get("Content-Encoding", "identity") not in ("identity", ""):
            return None
        if r.status == 206:
            size = _total(r.headers.get("Content-Range", ""))
        else:  # the whole file, the range ignored
            size = int(r.headers["Content-Length"]) if "Content-Length" in r.headers else None
        if size is None:
            return None
        if r.status == 200 and first:  # the range ignored: the info will do
            return _info(url, r, size), b""
        want = max(0, min(size - first, nbytes))
        content = await r.content.readexactly(want) if want else b""
        return _info(url, r, size), content


def _total(content_range: str) -> int | None:
    """The size in a Content-Range header (`bytes 0-99/1234`, `bytes */1234`)."""
    total = content_range.rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None


def _info(url: str, r, size: int) -> dict:
    info = {"name": url, "size": size}
    if "Content-Type" in r.headers:
        info["mimetype"] = r.headers["Content-Type"].partition(";")[0]
    if r.headers.get("Accept-Ranges") == "none":
        info["partial"] = False
    info["url"] = str(r.url)
    for field in VERSION_HEADERS:
        if r.headers.get(field):
            info[field] = r.headers[field]
    info["type"] = "file"
    return info
