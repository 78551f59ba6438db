"""An S3 endpoint for the peers that speak only S3: moto's server behind the store's throttle.

`S3Store` runs moto's `ThreadedMotoServer` on loopback and, in front of it, a
`StoreServer` whose handler forwards each GET or HEAD to moto instead of reading a file:
the same per-request latency, the same token-bucket bandwidth cap and the same counters
(`stats()`, `GET /__stats__`) as the HTTP store the other loaders read. Objects are put
straight into moto (`upload`), so filling the bucket is not counted. The peers run it in a
process of its own (`StoreProcess`), as they run the HTTP store::

    StoreProcess("benchmarks.peers.s3:main", "--latency", "0.002", "--bandwidth", "32MiB")  # its info["moto"], url
"""
from __future__ import annotations

import argparse
import io
import os
import socket
import tempfile

import aiohttp
from aiohttp import web

from ..store_server import StoreServer, serve_until_stopped

BUCKET = "bench"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
_REQUEST_DROP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}
_RESPONSE_KEEP = {"content-type", "content-range", "etag", "last-modified", "accept-ranges"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Store(StoreServer):
    """moto on loopback behind a counting, throttled proxy; `url` is the endpoint to give clients."""

    def __init__(self, latency: float = 0.0, bandwidth=None):
        from moto.server import ThreadedMotoServer  # ImportError without moto[server]: nothing made yet

        self._empty = tempfile.mkdtemp(prefix="dmdask-bench-s3-")
        super().__init__(self._empty, latency=latency, bandwidth=bandwidth)
        self._moto_port = _free_port()
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self._moto_port, verbose=False)
        self._session = None

    @property
    def moto_url(self) -> str:
        return f"http://127.0.0.1:{self._moto_port}"

    def start(self) -> "S3Store":
        self._moto.start()
        super().start()
        client(self.moto_url).create_bucket(Bucket=BUCKET)
        return self

    def stop(self) -> None:
        if self._session is not None and self._loop is not None:
            import asyncio

            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result()
            self._session = None
        super().stop()
        self._moto.stop()
        os.rmdir(self._empty)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        key, head = await self._admit(request)
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _REQUEST_DROP}
        async with self._session.request(request.method, self.moto_url + request.path_qs, headers=headers,
                                         allow_redirects=False) as upstream:
            body = await upstream.read()
            kept = {k: v for k, v in upstream.headers.items()
                    if k.lower() in _RESPONSE_KEEP or k.lower().startswith("x-amz-")}
            length = int(upstream.headers.get("Content-Length", 0)) if head else len(body)
            response = web.StreamResponse(status=upstream.status, headers=kept)
        return await self._send(request, response, key, length, head, io.BytesIO(body).read)


def client(moto_url: str):
    """A boto3 client straight to moto (not counted, not throttled)."""
    import boto3

    return boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def upload(moto_url: str, folder: str, prefix: str) -> int:
    """Put every file under `folder` at s3://BUCKET/prefix/<relative path>, straight into
    moto at `moto_url`; returns the objects put."""
    s3, count = client(moto_url), 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            s3.upload_file(path, BUCKET, f"{prefix}/{os.path.relpath(path, folder)}")
            count += 1
    return count


def environment(store) -> dict:
    """What a rank process needs to reach the bucket through the proxy (boto3, Mosaic)."""
    return dict(CREDENTIALS, AWS_ENDPOINT_URL=store.url, S3_ENDPOINT_URL=store.url, AWS_ALLOW_HTTP="true")


def main(argv=None) -> int:
    """Serve until SIGINT/SIGTERM, after printing ``MOTO <moto's url>`` and ``URL <the proxy's url>``."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    parser = argparse.ArgumentParser(prog="benchmarks.peers.s3", description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer (default 0)")
    parser.add_argument("--bandwidth", default=None, help="cap in bytes/s over all clients, e.g. 32MiB")
    args = parser.parse_args(argv)
    store = S3Store(latency=args.latency, bandwidth=args.bandwidth)
    serve_until_stopped(store, moto=store.moto_url)
    return 0

