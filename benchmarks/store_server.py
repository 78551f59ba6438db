"""A counting HTTP server on loopback that stands in for a shared parallel file system.

``StoreServer`` serves one folder read-only, counts every request and body byte it
sends, and can emulate a contended store: a latency before each request and one
bandwidth cap shared by all clients.  It speaks what fsspec's ``HTTPFileSystem`` (and
so zarr's ``FsspecStore``) needs: ``GET``/``HEAD`` with ``Content-Length`` and
``Accept-Ranges`` (and, for files, ``Last-Modified`` and an ``ETag`` of the
modification time and size, as object stores give), single ``Range`` requests (``206``, ``416``), ``If-Match`` (``412`` when the
file's ETag is another), ``404`` for missing
files and an HTML index of ``<a href="name">`` links (``name/`` for folders) for a
folder, which is what fsspec's ``ls``/``find``/``glob`` scrape.  It runs on aiohttp in
a background thread with its own event loop::

    with StoreServer("/data", latency=0.005, bandwidth="200MB") as store:
        fsspec.filesystem("http").cat_file(store.url + "/ds.zarr/zarr.json")
        store.stats()  # {"requests": 1, "bytes": ..., "head_requests": 0, "by_path": {...}}

``fail_first(n, pattern)`` makes it answer ``503 Service Unavailable`` to the first
``n`` GETs of each matching path from then on, as a store under load would;
``fail_every(k, pattern)`` to every ``k``-th GET of the matching paths; ``hang_every(k,
pattern, seconds)`` holds every ``k``-th GET that long before answering.

As a process (prints ``URL http://HOST:PORT``, serves until SIGINT/SIGTERM;
``GET /__stats__`` returns the counters as JSON, ``?reset=1`` also zeroes them)::

    python -m benchmarks.store_server ROOT --port 0 --latency 0.005 --bandwidth 200MB \
        [--fail-every K] [--hang-every K --hang-seconds S]

``StoreProcess`` runs it so from Python, with the same ``url``, ``stats()`` and
``reset_stats()``: a store that shares no interpreter lock with the benchmark.
"""
from __future__ import annotations

import argparse
import asyncio
import fnmatch
import html
import io
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

from aiohttp import web
from dask.utils import parse_bytes

CHUNK = 64 * 1024  # body chunk (and token-bucket burst) when throttled
STATS_PATH = "/__stats__"


class _Bucket:
    """A token bucket (tokens are bytes) shared by every response of one server, so
    the bytes sent in any interval T are at most CHUNK + rate * T.  Used only from the
    server's event loop, so it needs no lock."""

    def __init__(self, rate: float):
        self.rate, self.tokens, self.last = rate, float(CHUNK), time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(CHUNK, self.tokens + (now - self.last) * self.rate) - n
        self.last = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


class StoreServer:
    """Serve ``root`` read-only over HTTP on a loopback address, counting traffic.

    latency: seconds to wait before answering each request (not ``/__stats__``).
    bandwidth: cap in bytes/s over all clients together (a number, or a string such
        as ``"200MB"``); ``None`` for none.
    host: a loopback address or ``"localhost"``; anything else is a ``ValueError``.
    port: ``0`` picks a free port.

    Guarantees: paths never leave ``root`` (403; symlinks inside ``root`` are
    followed).  ``stats()["requests"]`` counts every GET but ``/__stats__``: files,
    folder listings and errors; ``"bytes"`` the bytes of file and listing bodies sent
    (not of error messages); ``"head_requests"`` the HEADs; ``"by_path"`` the GETs and
    bytes by path relative to ``root`` (``""`` for ``root`` itself); ``"failed"`` the
    GETs answered with an error status by ``fail_first`` or ``fail_every``.  A request is
    counted when it arrives and body bytes just before they are handed to the
    connection, so a client that has its response sees it in ``stats()`` (a client
    that hangs up mid-answer may be counted one chunk more).
    """

    def __init__(self, root, latency: float = 0.0, bandwidth=None, host: str = "127.0.0.1", port: int = 0):
        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise NotADirectoryError(f"StoreServer root is not a directory: {self.root!r}")
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency!r}")
        self.latency = float(latency)
        if isinstance(bandwidth, str):
            bandwidth = parse_bytes(bandwidth)  # ValueError if it is not a size
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"bandwidth must be positive bytes/s or None, got {bandwidth!r}")
        self.bandwidth = None if bandwidth is None else float(bandwidth)
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"StoreServer binds only to a loopback address, got {host!r}")
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self.fail_first(0)
        self.fail_every(0)
        self.hang_every(0)
        self.release()
        self.reset_stats()
        self._timeline = None  # (start, end) wall times of GETs, while `record_timeline` is on
        self._url = self._loop = self._thread = self._runner = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "StoreServer":
        """Bind and serve from a daemon thread; returns ``self``.  ``RuntimeError`` if
        already running; may be started again after ``stop()``."""
        if self._loop is not None:
            raise RuntimeError("StoreServer is already running")
        self._bucket = _Bucket(self.bandwidth) if self.bandwidth else None
        app = web.Application()
        app.router.add_get(STATS_PATH, self._stats_page)
        app.router.add_get("/{path:.*}", self._serve)  # HEAD too; other methods get 405
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)

        async def bind():
            await runner.setup()
            await web.TCPSite(runner, self.host, self.port).start()
            return runner.addresses[0][:2]

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="store-server", daemon=True)
        thread.start()

        try:
            host, port = asyncio.run_coroutine_threadsafe(bind(), loop).result()
        except BaseException:
            self._close(loop, thread, runner)
            raise
        self._url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._loop, self._thread, self._runner = loop, thread, runner
        return self

    def stop(self) -> None:
        """Close the listening socket and every connection (answers in progress are cut
        off), then end the thread.  Idempotent."""
        if self._loop is not None:
            self._close(self._loop, self._thread, self._runner)
            self._url = self._loop = self._thread = self._runner = None

    @staticmethod
    def _close(loop, thread, runner) -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def __enter__(self) -> "StoreServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, no trailing slash; ``RuntimeError`` when not running."""
        if self._url is None:
            raise RuntimeError("StoreServer is not running: call start() or use it in a `with` block")
        return self._url

    # -- counters ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """A copy of the counters (see the class docstring)."""
        with self._lock:
            return dict(self._stats, by_path={p: dict(v) for p, v in self._stats["by_path"].items()})

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {"requests": 0, "bytes": 0, "head_requests": 0, "failed": 0, "by_path": {}}

    def record_timeline(self, on: bool = True) -> None:
        """Start (again, from empty) or stop recording when each GET of a file starts and
        ends (``time.time()``): ``timeline()`` then tells how many were in flight when."""
        with self._lock:
            self._timeline = [] if on else None

    def timeline(self) -> list:
        """The recorded GETs of files as ``(start, end)`` wall times, by start."""
        with self._lock:
            return sorted(self._timeline or [])

    def fail_first(self, n: int, pattern: str = "*", status: int = 503) -> None:
        """From now on, answer ``status`` (an HTTP error, default 503 Service Unavailable)
        to the first ``n`` GETs of each path that matches ``pattern`` (``fnmatch`` on the
        path relative to ``root``, where ``*`` matches ``/`` too), and serve the later
        ones.  Each such answer counts as a GET (``requests``, ``by_path``) and in
        ``"failed"``.  ``fail_first(0)`` stops failing."""
        if n < 0 or not 400 <= status < 600:
            raise ValueError(f"fail_first needs n >= 0 and an HTTP error status, got {n!r}, {status!r}")
        with self._lock:
            self._fail, self._failed_paths = (n, pattern, status), {}

    def fail_every(self, k: int, pattern: str = "*", status: int = 503) -> None:
        """From now on, answer ``status`` to every ``k``-th GET of the paths that match
        ``pattern`` (counted over all of them): a store that throttles a steady share of the
        requests, as S3 answers 503 SlowDown under load.  ``fail_every(0)`` stops it."""
        if k < 0 or not 400 <= status < 600:
            raise ValueError(f"fail_every needs k >= 0 and an HTTP error status, got {k!r}, {status!r}")
        with self._lock:
            self._every = [k, pattern, status, 0]

    def hang_every(self, k: int, pattern: str = "*", seconds: float = 60.0) -> None:
        """From now on, hold every ``k``-th GET of the paths that match ``pattern`` (counted
        over all of them) ``seconds`` before answering it: a store whose requests sometimes
        hang.  ``hang_every(0)`` stops it (requests held already are answered late)."""
        if k < 0 or seconds < 0:
            raise ValueError(f"hang_every needs k >= 0 and seconds >= 0, got {k!r}, {seconds!r}")
        with self._lock:
            self._hang = [k, pattern, float(seconds), 0]

    def hold(self, which) -> None:
        """From now on, hold every GET of a path for which ``which(path)`` is true (the path
        relative to ``root``) until ``release()`` or until its client hangs up: a store
        whose answers for some objects come only when a test says so."""
        with self._lock:
            self._held = which

    def release(self) -> None:
        """Answer the GETs that ``hold`` holds, and hold no more."""
        with self._lock:
            self._held = None

    def _is_held(self, path: str) -> bool:
        with self._lock:
            return self._held is not None and bool(self._held(path))

    def _hang_for(self, path: str) -> float:
        with self._lock:
            k, pattern, seconds, seen = self._hang
            if not k or not fnmatch.fnmatchcase(path, pattern):
                return 0.0
            self._hang[3] = seen + 1
            if (seen + 1) % k:
                return 0.0
            self._stats["hung"] = self._stats.get("hung", 0) + 1
            return seconds

    def _should_fail(self, path: str):
        """The status to answer this GET of ``path`` with, or None to serve it."""
        with self._lock:
            k, every_pattern, every_status, seen = self._every
            if k and fnmatch.fnmatchcase(path, every_pattern):
                self._every[3] = seen = seen + 1
                if seen % k == 0:
                    self._stats["failed"] += 1
                    return every_status
            n, pattern, status = self._fail
            if not n or self._failed_paths.get(path, 0) >= n or not fnmatch.fnmatchcase(path, pattern):
                return None
            self._failed_paths[path] = self._failed_paths.get(path, 0) + 1
            self._stats["failed"] += 1
            return status

    def _count(self, path: str, requests: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            self._stats["requests"] += requests
            self._stats["bytes"] += nbytes
            entry = self._stats["by_path"].setdefault(path, {"requests": 0, "bytes": 0})
            entry["requests"] += requests
            entry["bytes"] += nbytes

    # -- handlers ----------------------------------------------------------------------------
    async def _stats_page(self, request: web.Request) -> web.Response:
        stats = self.stats()
        if request.query.get("reset") in ("1", "true"):
            self.reset_stats()
        return web.json_response(stats)

    async def _admit(self, request: web.Request):
        """Count the request and wait out the per-request latency; (object key, is a HEAD)."""
        rel = request.match_info["path"]
        key = "/".join(p for p in rel.split("/") if p not in ("", "."))
        head = request.method == "HEAD"
        if head:
            with self._lock:
                self._stats["head_requests"] += 1
        else:
            self._count(key, requests=1)
        if self.latency:
            await asyncio.sleep(self.latency)
        return key, head

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        rel = request.match_info["path"]
        key, head = await self._admit(request)
        hang = 0.0 if head else self._hang_for(key)
        until = time.monotonic() + hang
        while time.monotonic() < until or (not head and self._is_held(key)):  # until the client hangs up
            if request.transport is None or request.transport.is_closing():
                raise web.HTTPRequestTimeout()
            await asyncio.sleep(0.05)
        status = None if head else self._should_fail(key)
        if status is not None:
            return web.Response(status=status, text=f"failing on purpose: {key}\n")
        full = os.path.normpath(os.path.join(self.root, rel))
        if full != self.root and not full.startswith(self.root + os.sep):
            raise web.HTTPForbidden()
        if os.path.isdir(full):
            return await self._listing(request, key, full, head)
        if not os.path.isfile(full) or rel.endswith("/"):
            raise web.HTTPNotFound()
        st = os.stat(full)
        size = st.st_size
        try:
            rng = request.http_range
        except ValueError:  # malformed or several ranges: send the whole file (RFC 9110 allows it)
            rng = slice(None)
        if rng.start is not None and rng.start >= size > 0:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
        start, stop, _ = rng.indices(size)
        etag = f'"{st.st_mtime_ns:x}-{size:x}"'
        wanted = request.headers.get("If-Match")
        if wanted is not None and wanted.strip() != "*" and etag not in [t.strip() for t in wanted.split(",")]:
            raise web.HTTPPreconditionFailed(text=f"{key} is no longer the version asked for\n")
        response = web.StreamResponse(status=200, headers={"Accept-Ranges": "bytes", "ETag": etag})
        response.last_modified = st.st_mtime
        if (rng.start, rng.stop) != (None, None) and size:
            response.set_status(206)
            response.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        response.content_type = "application/octet-stream"
        started = time.time()
        with open(full, "rb") as f:
            f.seek(start)
            sent = await self._send(request, response, key, stop - start, head, f.read)
        with self._lock:
            if self._timeline is not None and not head:
                self._timeline.append((started - self.latency, time.time()))
        return sent

    async def _listing(self, request, key: str, folder: str, head: bool) -> web.StreamResponse:
        names = sorted(e.name + "/" if e.is_dir() else e.name for e in os.scandir(folder))
        links = "".join(f'<li><a href="{urllib.parse.quote(n)}">{html.escape(n)}</a></li>\n' for n in names)
        body = f"<!DOCTYPE html>\n<html><body><ul>\n{links}</ul></body></html>\n".encode()
        response = web.StreamResponse(headers={"Content-Type": "text/html; charset=utf-8"})
        return await self._send(request, response, key, len(body), head, io.BytesIO(body).read)

    async def _send(self, request, response, key: str, length: int, head: bool, read) -> web.StreamResponse:
        """Send ``length`` bytes from ``read(n)``, counting each chunk before it goes out
        and waiting for the bandwidth cap; for HEAD only the headers."""
        response.content_length = length
        await response.prepare(request)
        chunk = CHUNK if self._bucket else 1 << 20
        while not head and length > 0:
            data = read(min(chunk, length))
            if not data:
                raise ConnectionAbortedError("file shrank while being served")
            if self._bucket:
                await self._bucket.take(len(data))
            self._count(key, nbytes=len(data))
            await response.write(data)
            length -= len(data)
        await response.write_eof()
        return response


class StoreProcess:
    """A store server run by ``main(ARGS)`` of ``entry`` (``"module:main"``) in a process of its own, read through
    ``url``, ``stats()`` and ``reset_stats()`` as a ``StoreServer`` is (``GET /__stats__``).

    Why a process: a server thread in the benchmark's own process shares its interpreter
    lock, so whatever else that process does (polling /proc for the memory of every
    process of a run, walking the nodes' folders) delays the server's event loop, and an
    emulated store with a bandwidth cap then sends less than its cap whenever its queue
    is shallow; a real shared file system is slowed by nothing its clients' machine does.
    The process prints ``KEY value`` lines ending with ``URL http://HOST:PORT``; the keys
    before it are in ``info`` (lower case)."""

    def __init__(self, entry: str = "benchmarks.store_server:main", *args, timeout: float = 60.0):
        module, _, function = entry.partition(":")
        code = f"import sys; from {module} import {function}; sys.exit({function}(sys.argv[1:]))"
        self.command = [sys.executable, "-c", code, *map(str, args)]
        self.timeout, self.info, self._process, self._url = timeout, {}, None, None

    def start(self) -> "StoreProcess":
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True, env=env)
        timer = threading.Timer(self.timeout, self._process.kill)  # a server that never prints its URL
        timer.start()
        try:
            for line in self._process.stdout:
                key, _, value = line.strip().partition(" ")
                if key == "URL":
                    self._url = value
                    break
                self.info[key.lower()] = value
        finally:
            timer.cancel()
        if self._url is None:
            self.stop()
            raise RuntimeError(f"the store server {self.command[2]!r} {self.command[3:]} ended without printing its URL")
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s). Idempotent."""
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process.stdout.close()
            self._process = self._url = None

    def __enter__(self) -> "StoreProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("StoreProcess is not running: call start() or use it in a `with` block")
        return self._url

    def stats(self) -> dict:
        """The server's counters (``StoreServer.stats``)."""
        return self._stats_page("")

    def reset_stats(self) -> None:
        self._stats_page("?reset=1")

    def _stats_page(self, query: str) -> dict:
        with urllib.request.urlopen(self.url + STATS_PATH + query, timeout=self.timeout) as reply:
            return json.load(reply)


def serve_until_stopped(server: StoreServer, **info: str) -> None:
    """Run `server` until SIGINT/SIGTERM, after printing each of `info` as ``KEY value``
    and then ``URL http://HOST:PORT`` (what `StoreProcess` reads)."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with server:
        for key, value in info.items():
            print(f"{key.upper()} {value}", flush=True)
        print(f"URL {server.url}", flush=True)
        while not done.wait(0.5):
            pass


def main(argv=None) -> int:
    """Serve ROOT until SIGINT/SIGTERM, after printing ``URL http://HOST:PORT``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_server", description=__doc__.splitlines()[0])
    parser.add_argument("root", help="folder to serve")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="0 for a free port (default)")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer (default 0)")
    parser.add_argument("--bandwidth", default=None, help="cap in bytes/s over all clients, e.g. 200MB")
    parser.add_argument("--fail-every", type=int, default=0, metavar="K",
                        help="answer 503 to every K-th GET (fail_every; default 0: none)")
    parser.add_argument("--hang-every", type=int, default=0, metavar="K",
                        help="hold every K-th GET --hang-seconds before answering (hang_every; default 0: none)")
    parser.add_argument("--hang-seconds", type=float, default=60.0, help="how long a held GET waits (default 60)")
    args = parser.parse_args(argv)
    try:
        server = StoreServer(args.root, args.latency, args.bandwidth, args.host, args.port)
        server.fail_every(args.fail_every)
        server.hang_every(args.hang_every, seconds=args.hang_seconds)
    except (NotADirectoryError, ValueError) as exc:
        parser.error(str(exc))
    serve_until_stopped(server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
