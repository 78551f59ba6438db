"""The peer path on real processes: a rank whose host holds no block (`dmdask.client.host`
names another host, so nothing is mapped and every row crosses TCP) takes the rows of a
group from each holder's row channel in one message, exactly once even when a holder is
killed mid-group, over TLS when the cluster's comm is TLS; the channel serves only a
connection that knows the worker's secret."""
import os
import signal
import socket
import threading
import time

import dask.config
import distributed
import numpy as np
import pytest

import dmdask
from dmdask.protocol.rows import HEADER, send_frame, recv_header
from dmdask.protocol.worker import WorkerAPI
from dmdask.testing.datasets import write_zarr, zarr_label, zarr_sample

from conftest import wait_until

ELSEWHERE = {"dmdask.client.host": "127.0.0.9"}  # this rank's host: one with no worker


def peer_counts(client) -> dict[str, dict]:
    return {w: s["peer"] for w, s in dmdask.stats(client)["workers"].items()}


def holders_of_blocks(client, identity: str) -> dict[int, str]:
    """Block index -> the address of the worker holding it."""
    def held(dask_worker):
        return [k for k in dask_worker.data if k.startswith(f"dmdask-block-{identity}-")]

    return {int(k.rsplit("-", 1)[1]): w for w, keys in client.run(held).items() for k in keys}


def identity_of(client, url):
    return {d["url"]: d["identity"] for d in dmdask.stats(client)["datasets"]}[url]


@pytest.mark.parametrize("prefetch, shape, groups", [(2, (16,), (1, 1)), (8, (16,), (4, 4)), (None, (16,), (32, 32)),
                                                     (None, (2048,), (15, 32))])
def test_a_remote_group_is_one_message_per_holder(tmp_path, prefetch, shape, groups):
    """Warm, every group of batches costs each holder exactly one request on its row
    channel (each batch here has rows of both holders), and the rows are the right ones,
    in order, each sample once. By default, small batches go 32 a request, up to 8 MiB
    (`group`), or 32 MiB from other hosts' workers (`remote_group`: 8 KB rows)."""
    n, chunk = 1600, 100
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=shape, chunk=chunk)
    with dask.config.set(ELSEWHERE), dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=64, seed=3, prefetch=prefetch)
        assert len(np.concatenate([b["index"] for b in dmdask.batches(client, spec)])) == n  # loads every block
        holders = holders_of_blocks(client, identity_of(client, path))
        assert len(holders) == n // chunk and len(set(holders.values())) == 2
        for epoch in (1, 2):
            before = peer_counts(client)
            it = dmdask.batches(client, spec, epoch=epoch)
            ids = []
            for batch in it:
                np.testing.assert_array_equal(batch["x"], zarr_sample(batch["index"], shape))
                assert {holders[b] for b in (batch["index"] // chunk).tolist()} == set(holders.values())
                ids.append(batch["index"])
            after = peer_counts(client)
            assert np.array_equal(np.sort(np.concatenate(ids)), np.arange(n))
            assert (it.group, it.remote_group) == groups
            assert it.requests == 1 + -(-(len(ids) - 1) // it.remote_group)  # batch 0 alone, then groups
            for worker in after:  # one message per holder per group, whatever the blocks touched
                assert after[worker]["requests"] - before[worker]["requests"] == it.requests, (worker, it.requests)
            sent = sum(after[w]["bytes_out"] - before[w]["bytes_out"] for w in after)
            assert sent == n * (shape[0] * 4 + 8)  # every row crossed TCP once: "x" float32 and "label" int64


def test_large_rows_are_sent_from_the_arena_beside_small_fields_taken(tmp_path):
    """Rows of 2 KiB and more leave from the holder's arena pages (`Pieces`) while the
    dataset's small "label" field is taken into a buffer: both arrive right, in order, each
    sample once, and the holder sent exactly the rows' bytes."""
    n, chunk, shape = 240, 20, (4096,)  # "x": float32[4096], 16 KiB a row (>= ZERO_COPY_ROW_BYTES)
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=shape, chunk=chunk)
    with dask.config.set(ELSEWHERE), dmdask.LocalCluster(n_workers=1, ram="64 MiB") as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=16, seed=5)
        for _ in dmdask.batches(client, spec):  # loads every block
            pass
        before = peer_counts(client)
        ids = []
        for batch in dmdask.batches(client, spec, epoch=1):
            np.testing.assert_array_equal(batch["x"], zarr_sample(batch["index"], shape))
            np.testing.assert_array_equal(batch["label"], zarr_label(batch["index"]))
            ids.append(batch["index"])
        after = peer_counts(client)
        assert np.array_equal(np.sort(np.concatenate(ids)), np.arange(n))
        assert sum(after[w]["bytes_out"] - before[w]["bytes_out"] for w in after) == n * (4096 * 4 + 8)


def test_a_holder_killed_mid_group_loses_and_repeats_nothing(tmp_path):
    n, chunk = 3000, 50
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=(64,), chunk=chunk)
    with dask.config.set(ELSEWHERE), dmdask.LocalCluster(n_workers=3, ram="64 MiB") as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(path, batch_size=50, seed=5, prefetch=8)
        for _ in dmdask.batches(client, spec):  # every block loaded, on the three workers
            pass
        pids = client.run(os.getpid)
        victim = sorted(pids)[1]
        got, errors = [], []
        it = dmdask.batches(client, spec, epoch=1)

        def consume():
            try:
                for b in it:
                    np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (64,)))
                    got.append(b["index"])
                    time.sleep(0.01)  # a training step: groups are in flight meanwhile
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=consume)
        thread.start()
        wait_until(lambda: len(got) >= 5 or errors, 60, "batches handed out")
        os.kill(pids[victim], signal.SIGKILL)
        delivered_at_kill = len(got)
        thread.join(180)
        assert not errors, errors
        assert delivered_at_kill < n // 50
        ids = np.concatenate(got)
        assert len(ids) == n and np.array_equal(np.sort(ids), np.arange(n))


def test_rows_travel_over_tls_when_the_cluster_is_tls(tmp_path):
    # distributed.Security.temporary() makes its certificates with `cryptography` (the test extra)
    n = 800
    path = write_zarr(str(tmp_path / "d.zarr"), n, sample_shape=(8,), chunk=100)
    security = distributed.Security.temporary()
    with dask.config.set(ELSEWHERE), dmdask.LocalCluster(n_workers=2, ram="64 MiB", security=security) as cluster, \
            distributed.Client(cluster, security=security) as client:
        workers = list(client.scheduler_info()["workers"])
        assert all(w.startswith("tls://") for w in workers)
        spec = dmdask.Spec(path, batch_size=32, seed=1)
        for epoch in (0, 1):
            batches = list(dmdask.batches(client, spec, epoch=epoch))
            for b in batches:
                np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]))
            assert np.array_equal(np.sort(np.concatenate([b["index"] for b in batches])), np.arange(n))
        assert sum(p["requests"] for p in peer_counts(client).values()) > 0
        # the channel itself is TLS: a plain TCP hello is never served
        channel = client.sync(WorkerAPI(client.rpc).channel, workers[0])
        with socket.create_connection((channel.host, channel.port), timeout=10) as sock:
            sock.settimeout(10)
            send_frame(sock, {"secret": channel.secret})
            assert _closed_without_reply(sock)


def test_the_channel_serves_only_who_knows_the_workers_secret(tmp_path):
    path = write_zarr(str(tmp_path / "d.zarr"), 200, chunk=100)
    with dmdask.LocalCluster(n_workers=1, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        list(dmdask.batches(client, dmdask.Spec(path, batch_size=50)))
        (worker,) = client.scheduler_info()["workers"]
        channel = client.sync(WorkerAPI(client.rpc).channel, worker)
        key = f"dmdask-block-{identity_of(client, path)}-0"
        request = {"keys": [key], "n": 1, "priority": None, "wait": 0.0}
        for hello in ({"secret": "0" * 32}, {"nothing": 1}):
            with socket.create_connection((channel.host, channel.port), timeout=10) as sock:
                sock.settimeout(10)
                send_frame(sock, hello)
                send_frame(sock, request, [np.zeros(1, np.int32), np.zeros(1, np.int64)])
                assert _closed_without_reply(sock)
        with socket.create_connection((channel.host, channel.port), timeout=10) as sock:  # the secret: served
            sock.settimeout(10)
            send_frame(sock, {"secret": channel.secret})
            send_frame(sock, request, [np.zeros(1, np.int32), np.array([7], np.int64)])
            header = recv_header(sock)
            assert header["status"] == "rows" and sorted(f[0] for f in header["fields"]) == ["label", "x"]


def _closed_without_reply(sock) -> bool:
    """Whether the worker closed the connection (an end of file or a reset) with no reply."""
    try:
        return sock.recv(HEADER.size) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_pieces_arrive_whole_and_in_order_through_partial_sends():
    """`send_pieces` hands the kernel 1,024 ranges a call and carries on where a call
    stopped: a small send buffer makes every call partial, and the bytes received are the
    ranges' bytes, in order."""
    from dmdask.protocol.pieces import Pieces, send_pieces

    rng = np.random.default_rng(1)
    buffer = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    lengths = rng.integers(1, 700, 5000)
    starts = rng.integers(0, len(buffer) - 700, 5000)
    expected = b"".join(buffer[a:a + n].tobytes() for a, n in zip(starts, lengths))
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    got = bytearray()

    def receive():
        while len(got) < len(expected):
            got.extend(right.recv(65536))

    reader = threading.Thread(target=receive)
    reader.start()
    send_pieces(left, Pieces(buffer, starts, lengths))
    reader.join(30)
    left.close()
    right.close()
    assert bytes(got) == expected


def test_a_holder_silent_mid_reply_is_a_timeout_not_a_hang():
    """A holder that sends part of a reply, then nothing (paused, hung), keeping the
    connection open: the reader's blocking receive ends at its deadline (the socket's
    own, `SO_RCVTIMEO`) with a TimeoutError naming the holder, a lost worker to callers."""
    from dmdask.protocol.rows import RowChannels, asked_of
    from dmdask.protocol.worker import Channel

    listener = socket.create_server(("127.0.0.1", 0))
    stalled = threading.Event()

    def half_a_reply():
        conn, _ = listener.accept()
        with conn:
            recv_header(conn)  # the secret
            recv_header(conn)  # the request (its arrays follow; never read)
            send_frame(conn, {"status": "rows", "from_store": 0, "fields": [["x", "fixed", "<f8", [], 8 * 1000]]})
            conn.sendall(b"\0" * 4000)  # half the rows
            stalled.wait(60)

    server = threading.Thread(target=half_a_reply, daemon=True)
    server.start()
    channels = RowChannels(None, None, timeout=1.0)
    outcome = []

    def read():
        try:
            channels.exchange("tcp://127.0.0.1:1", Channel("127.0.0.1", listener.getsockname()[1], "s" * 32),
                              asked_of({"k": np.arange(1000)}))
            outcome.append("returned")
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(60)
    stalled.set()
    listener.close()
    assert not reader.is_alive(), "the reader still waits on a silent holder"
    assert isinstance(outcome[0], TimeoutError) and "tcp://127.0.0.1:1" in str(outcome[0]), outcome
