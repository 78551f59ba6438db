"""Tests for benchmarks.store_server (the stand-in shared store).

Timings are checked only from below (a latency or a bandwidth cap makes things at least
this slow): an upper bound on wall time fails on a loaded machine."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import numpy as np
import pytest

from benchmarks.store_server import CHUNK, StoreProcess, StoreServer
from conftest import wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def root(tmp_path):
    d = tmp_path / "store"
    (d / "folder" / "sub" / "deeper").mkdir(parents=True)
    (d / "folder" / "a.txt").write_bytes(b"hello world\n")
    rng = np.random.default_rng(0)
    (d / "folder" / "sub" / "b.bin").write_bytes(rng.bytes(10_000))
    (d / "folder" / "sub" / "deeper" / "c.bin").write_bytes(b"c" * 7)
    (d / "big.bin").write_bytes(rng.bytes(1_000_000))
    (tmp_path / "secret.txt").write_bytes(b"do not serve")
    return d


def _fs():
    # A fresh, uncached filesystem so listing caches never hide requests.
    return fsspec.filesystem("http", skip_instance_cache=True, use_listings_cache=False)


def _request(server, method, path, headers=None):
    """Raw request (no client-side path normalisation); returns (status, headers, body)."""
    parts = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, dict(resp.getheaders()), body
    finally:
        conn.close()


def test_cat_file_exact_bytes_and_counts(root):
    data = (root / "folder" / "sub" / "b.bin").read_bytes()
    with StoreServer(root) as server:
        assert server.url.startswith("http://127.0.0.1:") and not server.url.endswith("/")
        out = _fs().cat_file(server.url + "/folder/sub/b.bin")
        assert out == data
        stats = server.stats()
        assert stats["requests"] == 1
        assert stats["bytes"] == len(data)
        assert stats["head_requests"] == 0
        assert stats["by_path"] == {"folder/sub/b.bin": {"requests": 1, "bytes": len(data)}}
        server.reset_stats()
        assert server.stats()["requests"] == 0 and server.stats()["by_path"] == {}


def test_range_reads_count_only_range(root):
    data = (root / "folder" / "sub" / "b.bin").read_bytes()
    with StoreServer(root) as server:
        fs = _fs()
        url = server.url + "/folder/sub/b.bin"
        assert fs.cat_file(url, start=100, end=300) == data[100:300]
        assert server.stats()["requests"] == 1
        assert server.stats()["bytes"] == 200
        assert fs.cat_file(url, start=-50) == data[-50:]  # bytes=-50
        assert server.stats()["bytes"] == 250

        status, headers, body = _request(server, "GET", "/folder/sub/b.bin", {"Range": "bytes=9990-"})
        assert status == 206 and body == data[9990:]
        assert headers["Content-Range"] == "bytes 9990-9999/10000"
        assert headers["Content-Length"] == "10"
        status, headers, body = _request(server, "GET", "/folder/sub/b.bin", {"Range": "bytes=5-20000"})
        assert status == 206 and body == data[5:] and headers["Content-Range"] == "bytes 5-9999/10000"
        status, headers, body = _request(server, "GET", "/folder/sub/b.bin", {"Range": "bytes=10000-"})
        assert status == 416 and headers["Content-Range"] == "bytes */10000"  # bytes not counted
        status, _, body = _request(server, "GET", "/folder/sub/b.bin")
        assert status == 200 and body == data
        assert server.stats()["bytes"] == 250 + 10 + len(data) - 5 + len(data)
        assert server.stats()["by_path"]["folder/sub/b.bin"]["requests"] == 6


def test_malformed_or_multi_range_gets_the_whole_file(root):
    data = (root / "folder" / "sub" / "b.bin").read_bytes()
    with StoreServer(root) as server:
        for header in ["bytes=0-1,4-5", "items=0-1", "bytes=5-2", "bytes=garbage"]:
            status, headers, body = _request(server, "GET", "/folder/sub/b.bin", {"Range": header})
            assert (status, body) == (200, data), header
            assert "Content-Range" not in headers
        status, headers, body = _request(server, "GET", "/folder/sub/b.bin", {"Range": "bytes=0-4"})
        assert (status, body, headers["Content-Range"]) == (206, data[:5], "bytes 0-4/10000")
        assert server.stats()["bytes"] == 4 * len(data) + 5


def test_head_and_missing(root):
    with StoreServer(root) as server:
        status, headers, body = _request(server, "HEAD", "/folder/a.txt")
        assert status == 200 and body == b""
        assert headers["Content-Length"] == "12" and headers["Accept-Ranges"] == "bytes"
        assert _fs().info(server.url + "/folder/a.txt")["size"] == 12
        stats = server.stats()
        assert stats["head_requests"] == 2
        assert stats["requests"] == 0 and stats["bytes"] == 0

        with pytest.raises(FileNotFoundError):
            _fs().cat_file(server.url + "/folder/missing.bin")
        assert _request(server, "GET", "/folder/a.txt/")[0] == 404
        assert _request(server, "PUT", "/folder/a.txt")[0] == 405
        stats = server.stats()
        assert stats["requests"] == 2 and stats["head_requests"] == 2 and stats["bytes"] == 0


def test_ls_find_glob(root):
    with StoreServer(root) as server:
        fs = _fs()
        base = server.url + "/folder"
        expected = [base + "/a.txt", base + "/sub/"]
        assert sorted(fs.ls(base, detail=False)) == expected
        assert sorted(fs.ls(base + "/", detail=False)) == expected
        types = {e["name"]: e["type"] for e in fs.ls(base, detail=True)}
        assert types == {base + "/a.txt": "file", base + "/sub/": "directory"}
        assert sorted(fs.find(base)) == [
            base + "/a.txt", base + "/sub/b.bin", base + "/sub/deeper/c.bin",
        ]
        assert fs.glob(base + "/**/*.bin") == [base + "/sub/b.bin", base + "/sub/deeper/c.bin"]
        root_listing = fs.ls(server.url + "/", detail=False)
        assert sorted(root_listing) == [server.url + "/big.bin", server.url + "/folder/"]
        status, headers, body = _request(server, "GET", "/folder/")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b'<a href="a.txt">' in body and b'<a href="sub/">' in body


def test_ls_class_folders(tmp_path):
    """An ImageNet-style tree (class folders of files, odd names too), as fsspec lists it."""
    names = {"class-000": ["s-0.bin", "s-1.bin"], "class 001": ["a&b.bin"], "class-002": []}
    for folder, files in names.items():
        (tmp_path / folder).mkdir()
        for name in files:
            (tmp_path / folder / name).write_bytes(name.encode())
    with StoreServer(tmp_path) as server:
        fs = _fs()
        listing = fs.ls(server.url + "/", detail=True)
        assert sorted((e["name"], e["type"]) for e in listing) == sorted(
            (server.url + "/" + urllib.parse.quote(folder) + "/", "directory") for folder in names)
        assert sorted(fs.ls(server.url + "/class-000", detail=False)) == [
            server.url + "/class-000/s-0.bin", server.url + "/class-000/s-1.bin"]
        assert fs.cat_file(server.url + "/class%20001/a%26b.bin") == b"a&b.bin"
        assert fs.ls(server.url + "/class-002", detail=False) == []
        assert server.stats()["by_path"]["class-000"]["requests"] == 1


@pytest.mark.filterwarnings("ignore:Consolidated metadata:UserWarning")
def test_zarr_roundtrip_over_http(root):
    import zarr
    path = root / "ds.zarr"
    group = zarr.open_group(str(path), mode="w")
    x = np.arange(60 * 50, dtype="float32").reshape(60, 50)
    y = np.arange(100, dtype="int64") * 3
    group.create_array("x", shape=x.shape, chunks=(20, 25), dtype=x.dtype)[:] = x
    group.create_array("y", shape=y.shape, chunks=(30,), dtype=y.dtype)[:] = y
    zarr.consolidate_metadata(str(path))
    chunk_bytes = sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and "c" in p.relative_to(path).parts
    )
    assert chunk_bytes > 0

    with StoreServer(root) as server:
        store = zarr.storage.FsspecStore.from_url(server.url + "/ds.zarr", read_only=True)
        remote = zarr.open_group(store, mode="r", use_consolidated=True)
        np.testing.assert_array_equal(remote["x"][:], x)
        np.testing.assert_array_equal(remote["y"][:], y)
        stats = server.stats()
        assert stats["bytes"] >= chunk_bytes
        # every chunk file (3*2 for x, 4 for y) was read from the server
        chunk_paths = [p for p in stats["by_path"] if "/c/" in p]
        assert len(chunk_paths) == 10
        assert "ds.zarr/zarr.json" in stats["by_path"]


def test_bandwidth_cap(root):
    data = (root / "big.bin").read_bytes()
    with StoreServer(root, bandwidth="2MB") as server:
        assert server.bandwidth == 2_000_000
        fs = _fs()
        t0 = time.perf_counter()
        assert fs.cat_file(server.url + "/big.bin") == data
        assert time.perf_counter() - t0 >= (len(data) - CHUNK) / 2e6  # a lower bound only
        assert server.stats()["bytes"] == len(data)


def test_bandwidth_is_shared_between_clients(root):
    data = (root / "big.bin").read_bytes()
    with StoreServer(root, bandwidth=2_000_000) as server:
        fs = _fs()
        quarter = len(data) // 4
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            parts = list(pool.map(
                lambda i: fs.cat_file(server.url + "/big.bin", start=i * quarter, end=(i + 1) * quarter),
                range(4),
            ))
        assert time.perf_counter() - t0 >= (len(data) - CHUNK) / 2e6  # 1 MB in all at 2 MB/s
        assert b"".join(parts) == data
        assert server.stats()["requests"] == 4 and server.stats()["bytes"] == len(data)


def test_latency(root):
    with StoreServer(root, latency=0.1) as server:
        t0 = time.perf_counter()
        for _ in range(3):
            assert _request(server, "GET", "/folder/a.txt")[0] == 200
        assert time.perf_counter() - t0 >= 0.3  # a lower bound only
        _request(server, "GET", "/__stats__")  # not counted
        assert server.stats()["requests"] == 3


def test_many_concurrent_clients(root):
    data = (root / "folder" / "sub" / "b.bin").read_bytes()
    with StoreServer(root, latency=0.01) as server:
        def get(_):
            with urllib.request.urlopen(server.url + "/folder/sub/b.bin", timeout=10) as r:
                return r.read()

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(get, range(200)))
        assert all(r == data for r in results)
        stats = server.stats()
        assert stats["requests"] == 200 and stats["bytes"] == 200 * len(data)


def test_path_escape_refused(root):
    with StoreServer(root / "folder") as server:
        for path in ["/../secret.txt", "/sub/../../secret.txt", "/%2e%2e/secret.txt",
                     "/..%2fsecret.txt", "/sub/%2E%2E/%2E%2E/big.bin"]:
            status, _, body = _request(server, "GET", path)
            assert status in (403, 404), path
            assert b"do not serve" not in body
        assert server.stats()["bytes"] == 0 and server.stats()["requests"] == 5


def test_errors_and_lifecycle(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="file.txt"):
        StoreServer(f)
    with pytest.raises(NotADirectoryError, match="nope"):
        StoreServer(tmp_path / "nope")
    with pytest.raises(ValueError, match="loopback"):
        StoreServer(tmp_path, host="0.0.0.0")
    with pytest.raises(ValueError):
        StoreServer(tmp_path, bandwidth="fast")
    server = StoreServer(tmp_path)
    with pytest.raises(RuntimeError):
        server.url
    server.start()
    with pytest.raises(RuntimeError):
        server.start()
    assert _request(server, "GET", "/file.txt")[2] == b"x"
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(RuntimeError):
        server.url
    server.start()  # again, after stop()
    assert _request(server, "GET", "/file.txt")[2] == b"x"
    server.stop()
    assert StoreServer(tmp_path, bandwidth="200MB").bandwidth == 200e6
    assert StoreServer(tmp_path, bandwidth=1.5e6).bandwidth == 1.5e6
    with StoreServer(tmp_path, host="localhost") as server:
        assert _request(server, "GET", "/file.txt")[2] == b"x"


def test_stop_cuts_a_throttled_transfer(root):
    server = StoreServer(root, bandwidth=10_000).start()  # big.bin would take 100 s
    url = server.url + "/big.bin"
    errors = []

    def reader():
        try:
            urllib.request.urlopen(url, timeout=30).read()
        except Exception as exc:  # the connection is cut by stop()
            errors.append(exc)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    wait_until(lambda: server.stats()["bytes"], 30, "the server sent big.bin's first bytes", pause=0.01)
    server.stop()
    t.join()
    assert len(errors) == 1
    assert 0 < server.stats()["bytes"] < 1_000_000


def test_subprocess_mode(root):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.store_server", str(root),
         "--port", "0", "--latency", "0.005", "--bandwidth", "200MB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env,
    )
    killer = threading.Timer(30, proc.kill)
    killer.start()
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("URL http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" ", 1)[1]
        data = (root / "folder" / "a.txt").read_bytes()
        assert _fs().cat_file(url + "/folder/a.txt") == data
        with urllib.request.urlopen(url + "/__stats__", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("application/json")
            stats = json.loads(r.read())
        assert stats["requests"] == 1 and stats["bytes"] == len(data)
        assert stats["by_path"] == {"folder/a.txt": {"requests": 1, "bytes": len(data)}}
        with urllib.request.urlopen(url + "/__stats__?reset=1", timeout=10) as r:
            assert json.loads(r.read())["requests"] == 1
        with urllib.request.urlopen(url + "/__stats__", timeout=10) as r:
            assert json.loads(r.read())["requests"] == 0
    finally:
        proc.terminate()
        try:
            rc = proc.wait(10)
        finally:
            killer.cancel()
            proc.stdout.close()
            proc.stderr.close()
    assert rc == 0


def test_fail_first_answers_503_to_the_first_gets_of_matching_paths(root):
    data = (root / "folder" / "sub" / "b.bin").read_bytes()
    with StoreServer(root) as server:
        server.fail_first(2, "folder/sub/*")
        assert [_request(server, "GET", "/folder/sub/b.bin")[0] for _ in range(3)] == [503, 503, 200]
        assert _request(server, "GET", "/folder/sub/b.bin")[2] == data
        assert _request(server, "HEAD", "/folder/sub/deeper/c.bin")[0] == 200  # HEADs are never failed
        assert [_request(server, "GET", "/folder/sub/deeper/c.bin")[0] for _ in range(3)] == [503, 503, 200]
        assert _request(server, "GET", "/folder/a.txt")[0] == 200  # does not match
        stats = server.stats()
        assert stats["failed"] == 4 and stats["requests"] == 8
        assert stats["by_path"]["folder/sub/b.bin"] == {"requests": 4, "bytes": 2 * len(data)}
        server.fail_first(1, status=500)  # armed again: counts start afresh, every path matches
        assert [_request(server, "GET", "/folder/sub/b.bin")[0] for _ in range(2)] == [500, 200]
        server.fail_first(0)
        assert _request(server, "GET", "/folder/a.txt")[0] == 200
        assert server.stats()["failed"] == 5
        with pytest.raises(ValueError):
            server.fail_first(-1)
        with pytest.raises(ValueError):
            server.fail_first(1, status=200)


def test_store_process_serves_and_counts_from_a_process_of_its_own(root):
    """`StoreProcess`: the server in its own process, read through the same url, stats()
    and reset_stats() as an in-process `StoreServer`; a server that cannot start is named."""
    data = (root / "folder" / "a.txt").read_bytes()
    with StoreProcess("benchmarks.store_server:main", root, "--latency", "0.001", "--bandwidth", "200MB") as store:
        process = store._process
        assert process.pid != os.getpid() and store.url.startswith("http://127.0.0.1:")
        assert _fs().cat_file(store.url + "/folder/a.txt") == data
        assert store.stats()["by_path"] == {"folder/a.txt": {"requests": 1, "bytes": len(data)}}
        store.reset_stats()
        assert store.stats()["requests"] == 0
    assert process.returncode == 0  # stopped by SIGTERM, cleanly
    store.stop()  # idempotent
    with pytest.raises(RuntimeError, match="without printing its URL"):
        StoreProcess("benchmarks.store_server:main", root / "no-such-folder").start()
