"""A read-only HTTP server that stands in for a shared parallel file system.

``StoreServer`` serves one folder over HTTP on a loopback address, counts
every request and every body byte it sends, and can emulate a contended
store: a fixed latency before each counted request and an aggregate
bandwidth cap (one token bucket shared by all clients).

It speaks what fsspec's ``HTTPFileSystem`` (and so zarr's ``FsspecStore``)
needs: ``GET`` with ``Content-Length``, single ``Range`` requests answered
with ``206``/``Content-Range``, ``HEAD`` with ``Content-Length`` and
``Accept-Ranges: bytes``, ``404`` for missing files and HTML directory
indexes (``<a href="name">``, folders as ``name/``) for ``ls``/``find``/
``glob``.  Connections are HTTP/1.1 keep-alive.

In-process use::

    with StoreServer("/data", latency=0.005, bandwidth="200MB") as server:
        fs = fsspec.filesystem("http")
        fs.cat_file(server.url + "/ds.zarr/zarr.json")
        server.stats()  # {"requests": 1, "bytes": ..., "by_path": {...}, ...}

As a separate process (prints ``URL http://127.0.0.1:PORT`` and serves until
killed; ``GET /__stats__`` returns the statistics as JSON and is itself not
counted; ``GET /__stats__?reset=1`` returns them and resets them)::

    python -m dmdask.testing.store_server ROOT --port 0 --latency 0.005 --bandwidth 200MB
"""

from __future__ import annotations

import argparse
import copy
import email.utils
import html
import ipaddress
import json
import mimetypes
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

__all__ = ["StoreServer", "TokenBucket", "parse_bandwidth", "main"]

#: Largest body chunk written at once (and the bucket's default burst size).
CHUNK_SIZE = 64 * 1024
#: Request path that returns the statistics as JSON (not counted).
STATS_PATH = "/__stats__"

_UNTHROTTLED_CHUNK = 1024 * 1024
_JOIN_TIMEOUT = 2.0


def parse_bandwidth(value: float | int | str | None) -> float | None:
    """Return a bandwidth in bytes/s, or ``None`` for unthrottled.

    Numbers are bytes/s; strings are parsed with ``dask.utils.parse_bytes``
    (``"200MB"`` -> 2e8, a trailing ``"/s"`` is accepted); ``None``,
    ``"none"`` and ``"inf"`` mean unthrottled.  Raises ``ValueError`` for a
    value that is not positive or cannot be parsed.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "inf", "unlimited"):
            return None
        if text.lower().endswith("/s"):
            text = text[:-2]
        from dask.utils import parse_bytes

        try:
            rate = float(parse_bytes(text))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"cannot parse bandwidth {value!r}: {exc}") from None
    else:
        rate = float(value)
    if rate == float("inf"):
        return None
    if not rate > 0:
        raise ValueError(f"bandwidth must be positive bytes/s or None, got {value!r}")
    return rate


class TokenBucket:
    """Thread-safe token bucket: an aggregate rate shared by all callers.

    ``acquire(n)`` reserves ``n`` tokens (bytes) and blocks until the bucket
    has paid for them, so the total granted over any interval ``T`` is at
    most ``burst + rate * T`` however many threads call it.  Reservations are
    served in call order.  The bucket starts full.
    """

    def __init__(self, rate: float, burst: int = CHUNK_SIZE):
        if not rate > 0:
            raise ValueError(f"rate must be positive, got {rate!r}")
        if burst < 0:
            raise ValueError(f"burst must be >= 0, got {burst!r}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, n: int, cancel: threading.Event | None = None) -> bool:
        """Take ``n`` tokens, waiting as needed.

        Returns ``True`` once they are granted, or ``False`` if ``cancel`` was
        set while waiting (the tokens stay spent).
        """
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            deficit = -self._tokens
        if deficit <= 0:
            return True
        delay = deficit / self.rate
        if cancel is None:
            time.sleep(delay)
            return True
        return not cancel.wait(delay)


class _Stats:
    """Thread-safe request/byte counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._requests = 0
            self._bytes = 0
            self._head = 0
            self._errors = 0
            self._by_path: dict[str, dict[str, int]] = {}

    def request(self, relpath: str | None, head: bool = False) -> None:
        with self._lock:
            if head:
                self._head += 1
                return
            self._requests += 1
            if relpath is not None:
                entry = self._by_path.setdefault(relpath, {"requests": 0, "bytes": 0})
                entry["requests"] += 1

    def error(self) -> None:
        with self._lock:
            self._errors += 1

    def add_bytes(self, relpath: str | None, n: int) -> None:
        with self._lock:
            self._bytes += n
            if relpath is not None:
                entry = self._by_path.setdefault(relpath, {"requests": 0, "bytes": 0})
                entry["bytes"] += n

    def snapshot(self, reset: bool = False) -> dict[str, Any]:
        with self._lock:
            out = {
                "requests": self._requests,
                "bytes": self._bytes,
                "head_requests": self._head,
                "errors": self._errors,
                "by_path": copy.deepcopy(self._by_path),
            }
        if reset:
            self.reset()
        return out


class _Stopping(Exception):
    """Raised inside a handler when the server is shutting down."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dmdask-store-server/1"
    sys_version = ""
    disable_nagle_algorithm = True
    # Buffer writes so headers and small bodies leave in one segment; the
    # base class flushes after every request.
    wbufsize = 256 * 1024
    # Idle keep-alive connections are dropped after this many seconds.
    timeout = 300

    server: "_HTTPServer"

    # -- plumbing ---------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        if self.server.store.verbose:
            super().log_message(format, *args)

    def _send_empty(self, status: int, headers: dict[str, str] | None = None,
                    close: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

    def _error(self, status: int) -> None:
        self.server.store._stats.error()
        self._send_empty(status)

    def _resolve(self) -> tuple[str | None, str | None, bool, dict[str, list[str]]]:
        """Return ``(relpath, filesystem path, trailing slash, query)``.

        ``relpath`` is ``None`` when the path is refused (escape attempt).
        """
        split = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(split.path)
        query = urllib.parse.parse_qs(split.query)
        if "\x00" in path or "\\" in path:
            return None, None, False, query
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            return None, None, False, query
        relpath = "/".join(parts)
        fspath = os.path.join(self.server.store.root, *parts)
        return relpath, fspath, path.endswith("/") and bool(parts), query

    def _wait_latency(self) -> None:
        latency = self.server.store.latency
        if latency > 0 and self.server.store._stopping.wait(latency):
            raise _Stopping

    def _write_body(self, relpath: str, data_source, length: int) -> None:
        """Write ``length`` bytes from ``data_source`` (a file or bytes),
        counting each chunk before it is written and throttling if asked."""
        store = self.server.store
        bucket = store._bucket
        stopping = store._stopping
        if bucket is None:
            chunk = _UNTHROTTLED_CHUNK
        else:
            chunk = int(max(1024, min(CHUNK_SIZE, bucket.rate / 50)))
        view = memoryview(data_source) if isinstance(data_source, bytes) else None
        offset = 0
        while offset < length:
            n = min(chunk, length - offset)
            if view is not None:
                block = view[offset:offset + n]
            else:
                block = data_source.read(n)
                if not block:  # file shrank underneath us
                    raise ConnectionAbortedError("file truncated while serving")
                n = len(block)
            if bucket is not None and not bucket.acquire(n, stopping):
                raise _Stopping
            if stopping.is_set():
                raise _Stopping
            # Count before writing, so a client that has received the data
            # always sees it in stats(); un-count if the write fails.
            store._stats.add_bytes(relpath, n)
            try:
                self.wfile.write(block)
                if bucket is not None:
                    self.wfile.flush()
            except BaseException:
                store._stats.add_bytes(relpath, -n)
                raise
            offset += n

    # -- methods ------------------------------------------------------------
    def do_GET(self) -> None:
        try:
            self._serve(head=False)
        except _Stopping:
            self.close_connection = True

    def do_HEAD(self) -> None:
        try:
            self._serve(head=True)
        except _Stopping:
            self.close_connection = True

    def _read_only(self) -> None:
        self.server.store._stats.error()
        self._send_empty(HTTPStatus.METHOD_NOT_ALLOWED, {"Allow": "GET, HEAD"}, close=True)

    do_PUT = do_POST = do_DELETE = do_PATCH = _read_only

    def _serve(self, head: bool) -> None:
        store = self.server.store
        relpath, fspath, trailing, query = self._resolve()

        if relpath == STATS_PATH.lstrip("/") and not trailing:
            reset = query.get("reset", ["0"])[-1].lower() in ("1", "true", "yes")
            body = json.dumps(store._stats.snapshot(reset=reset)).encode()
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if not head:
                self.wfile.write(body)
            return

        store._stats.request(relpath, head=head)
        self._wait_latency()
        if relpath is None:
            self._error(HTTPStatus.FORBIDDEN)
            return
        if os.path.isdir(fspath):
            self._serve_listing(relpath, fspath, head)
            return
        if trailing:
            self._error(HTTPStatus.NOT_FOUND)
            return
        try:
            f = open(fspath, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            self._error(HTTPStatus.NOT_FOUND)
            return
        except PermissionError:
            self._error(HTTPStatus.FORBIDDEN)
            return
        with f:
            st = os.fstat(f.fileno())
            size = st.st_size
            rng = _parse_range(self.headers.get("Range"), size)
            headers = {
                "Content-Type": mimetypes.guess_type(fspath)[0] or "application/octet-stream",
                "Accept-Ranges": "bytes",
                "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
                "ETag": f'"{st.st_mtime_ns:x}-{size:x}"',
            }
            if rng == "unsatisfiable":
                store._stats.error()
                self._send_empty(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                                 {"Content-Range": f"bytes */{size}", "Accept-Ranges": "bytes"})
                return
            if rng is None:
                start, length = 0, size
                self.send_response(HTTPStatus.OK)
            else:
                start, end = rng
                length = end - start + 1
                self.send_response(HTTPStatus.PARTIAL_CONTENT)
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if head:
                return
            if start:
                f.seek(start)
            self._write_body(relpath, f, length)

    def _serve_listing(self, relpath: str, fspath: str, head: bool) -> None:
        try:
            entries = sorted(os.scandir(fspath), key=lambda e: e.name)
        except PermissionError:
            self._error(HTTPStatus.FORBIDDEN)
            return
        title = html.escape("/" + relpath + ("/" if relpath else ""))
        lines = [
            "<!DOCTYPE html>",
            "<html><head><meta charset=\"utf-8\">",
            f"<title>Index of {title}</title></head>",
            f"<body><h1>Index of {title}</h1><ul>",
        ]
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                continue
            name = entry.name + ("/" if is_dir else "")
            href = urllib.parse.quote(name)
            lines.append(f'<li><a href="{href}">{html.escape(name)}</a></li>')
        lines.append("</ul></body></html>\n")
        body = "\n".join(lines).encode("utf-8")
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self._write_body(relpath, body, len(body))


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """Parse a single ``bytes=`` range against ``size``.

    Returns ``(first, last)`` (inclusive), ``"unsatisfiable"``, or ``None``
    to serve the whole file (no header, malformed or multi-range header, or
    an empty file -- all allowed by RFC 9110).
    """
    if not header or size == 0:
        return None
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first_s, sep, last_s = spec.strip().partition("-")
    first_s, last_s = first_s.strip(), last_s.strip()
    if not sep or not (first_s.isdigit() or first_s == "") or not (last_s.isdigit() or last_s == ""):
        return None
    if first_s == "":
        if last_s == "":
            return None
        suffix = int(last_s)
        if suffix == 0:
            return "unsatisfiable"
        return max(0, size - suffix), size - 1
    first = int(first_s)
    if last_s and int(last_s) < first:
        return None  # invalid range: ignore the header
    if first >= size:
        return "unsatisfiable"
    last = int(last_s) if last_s else size - 1
    return first, min(last, size - 1)


class _HTTPServer(HTTPServer):
    """HTTPServer with one daemon thread per connection, tracked so that
    ``stop`` can close open keep-alive connections and join the threads."""

    allow_reuse_address = True
    request_queue_size = 1024
    daemon_threads = True
    store: "StoreServer"

    def __init__(self, address, handler, store: "StoreServer"):
        self.store = store
        self._active: dict[socket.socket, threading.Thread] = {}
        self._active_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        thread = threading.Thread(
            target=self._process_thread, args=(request, client_address),
            name=f"store-server-conn-{client_address[1]}", daemon=True,
        )
        with self._active_lock:
            self._active[request] = thread
        thread.start()

    def _process_thread(self, request, client_address):
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self._active_lock:
                self._active.pop(request, None)
            self.shutdown_request(request)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, _Stopping)) or self.store._stopping.is_set():
            return  # client went away, or we are shutting down
        super().handle_error(request, client_address)

    def close_connections(self) -> list[threading.Thread]:
        with self._active_lock:
            items = list(self._active.items())
        for sock, _ in items:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return [thread for _, thread in items]


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


def _check_loopback(host: str) -> str:
    if host == "localhost":
        return "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(f"host must be a loopback IP address or 'localhost', got {host!r}") from None
    if not addr.is_loopback:
        raise ValueError(f"StoreServer binds only to loopback addresses, got {host!r}")
    return str(addr)


class StoreServer:
    """Serve ``root`` read-only over HTTP on loopback, counting traffic.

    Parameters
    ----------
    root : folder to serve (``NotADirectoryError`` if it is not one).
    latency : seconds slept before answering each counted GET/HEAD request.
    bandwidth : aggregate cap in bytes/s over all clients (number, or string
        for ``dask.utils.parse_bytes`` such as ``"200MB"``); ``None`` means
        unthrottled.  Bodies go out in chunks of at most 64 KiB, each
        waiting for tokens from one shared ``TokenBucket``.
    host : loopback address to bind (``ValueError`` otherwise).
    port : TCP port, ``0`` for a free one.
    burst : token-bucket capacity in bytes (default 64 KiB).
    verbose : log each request to stderr.

    Guarantees
    ----------
    * Paths never escape ``root``: ``..`` segments are refused with 403
      (symlinks placed inside ``root`` are followed).
    * ``stats()`` counts every GET except ``/__stats__`` -- files, directory
      listings and errors -- in ``"requests"`` and every body byte actually
      written in ``"bytes"``; ``by_path`` breaks these down by path relative
      to ``root`` (``""`` is the root listing).  HEAD requests are counted
      only in ``"head_requests"``; ``"errors"`` counts 4xx answers.  Counters
      are updated before data are written, so once a client has a response
      it is visible in ``stats()``.  Error responses have empty bodies.
    * ``stop()`` closes open connections, aborts throttled/latent answers in
      progress and returns within about two seconds; all threads are daemons.
    """

    def __init__(self, root: str | os.PathLike, latency: float = 0.0,
                 bandwidth: float | int | str | None = None, host: str = "127.0.0.1",
                 port: int = 0, *, burst: int = CHUNK_SIZE, verbose: bool = False):
        root = os.fspath(root)
        if not os.path.isdir(root):
            raise NotADirectoryError(f"StoreServer root is not a directory: {root!r}")
        latency = float(latency)
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency!r}")
        self.root = os.path.abspath(root)
        self.latency = latency
        self.bandwidth = parse_bandwidth(bandwidth)
        self.host = _check_loopback(host)
        self.port = int(port)
        self.verbose = verbose
        self._burst = burst
        self._bucket = TokenBucket(self.bandwidth, burst) if self.bandwidth else None
        self._stats = _Stats()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> "StoreServer":
        """Bind and start serving in a daemon thread; returns ``self``.

        Raises ``RuntimeError`` if already running.  May be called again
        after ``stop()`` (with ``port=0`` the new port may differ).
        """
        with self._lock:
            if self._httpd is not None:
                raise RuntimeError("StoreServer is already running")
            self._stopping.clear()
            cls = _HTTPServer6 if ":" in self.host else _HTTPServer
            httpd = cls((self.host, self.port), _Handler, self)
            self._httpd = httpd
            self._thread = threading.Thread(
                target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                name=f"store-server-{httpd.server_address[1]}", daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close connections and join threads. Idempotent."""
        with self._lock:
            httpd, thread = self._httpd, self._thread
            self._httpd = self._thread = None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()
        deadline = time.monotonic() + _JOIN_TIMEOUT
        for conn_thread in httpd.close_connections():
            conn_thread.join(max(0.0, deadline - time.monotonic()))
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "StoreServer":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._httpd is not None

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (no trailing slash); ``RuntimeError`` if not running."""
        httpd = self._httpd
        if httpd is None:
            raise RuntimeError("StoreServer is not running; call start() or use it as a context manager")
        host, port = httpd.server_address[:2]
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"

    # -- statistics ---------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A snapshot: ``{"requests", "bytes", "head_requests", "errors",
        "by_path": {relpath: {"requests", "bytes"}}}`` (see class docstring)."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        """Zero all counters."""
        self._stats.reset()

    def __repr__(self) -> str:
        where = self.url if self.running else "stopped"
        return (f"StoreServer({self.root!r}, latency={self.latency}, "
                f"bandwidth={self.bandwidth}, {where})")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: serve ROOT until killed (SIGINT/SIGTERM)."""
    parser = argparse.ArgumentParser(
        prog="python -m dmdask.testing.store_server",
        description="Serve a folder read-only over HTTP on loopback, counting traffic. "
                    "Prints 'URL http://HOST:PORT'; GET /__stats__ returns counters as JSON.",
    )
    parser.add_argument("root", help="folder to serve")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port, 0 for a free one (default 0)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per request (default 0)")
    parser.add_argument("--bandwidth", default=None,
                        help="aggregate cap in bytes/s, e.g. 200MB (default: unthrottled)")
    parser.add_argument("--burst", type=int, default=CHUNK_SIZE, help="token bucket size in bytes")
    parser.add_argument("--verbose", action="store_true", help="log requests to stderr")
    args = parser.parse_args(argv)
    try:
        server = StoreServer(args.root, latency=args.latency, bandwidth=args.bandwidth,
                             host=args.host, port=args.port, burst=args.burst,
                             verbose=args.verbose)
    except (NotADirectoryError, ValueError) as exc:
        parser.error(str(exc))
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with server:
        print(f"URL {server.url}", flush=True)
        while not done.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
