"""Faults of a worker's own devices and of the shared store, on real worker processes:
an unusable SSD folder, SSD blocks whose files vanish, transient store errors."""
import errno
import logging
import os
import shutil
import subprocess
import threading

import dask
import distributed
import numpy as np
import pytest

import dmdask
from dmdask.testing.datasets import folder_sample, write_folder, write_zarr, zarr_sample
from dmdask.worker.holdings import Block
from dmdask.worker.tiers import TieredStore
from benchmarks.store_server import StoreServer

from conftest import all_ids, run_epoch


def can_mount():
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture
def unusable(tmp_path, request):
    """An `ssd_dir` that cannot hold the tier's folder, and a fragment of the reason."""
    kind = request.param
    if kind == "a file":
        path = tmp_path / "ssd-file"
        path.write_bytes(b"not a folder")
        yield str(path), "File exists"
    elif kind == "under a file":
        (tmp_path / "plain").write_bytes(b"not a folder")
        yield str(tmp_path / "plain" / "ssd"), "Not a directory"
    else:  # a read-only bind mount (as root, permissions alone would not stop the worker)
        path = tmp_path / "read-only"
        path.mkdir()
        if not can_mount():
            pytest.skip("needs root and mount for a read-only bind mount")
        if subprocess.run(["mount", "--bind", str(path), str(path)]).returncode:
            pytest.skip("bind mount refused here")
        try:
            if subprocess.run(["mount", "-o", "remount,ro,bind", str(path)]).returncode:
                pytest.skip("read-only remount refused here")
            yield str(path), "Read-only file system"
        finally:
            subprocess.run(["umount", "-l", str(path)])


@pytest.mark.parametrize("unusable", ["a file", "under a file", "read-only"], indirect=True)
def test_unusable_ssd_dir_is_reported_and_training_goes_on(tmp_path, unusable):
    ssd_dir, reason = unusable
    path = write_zarr(str(tmp_path / "d.zarr"), 400, chunk=50)
    with dmdask.LocalCluster(n_workers=2, ram=0, ssd="1 MiB", ssd_dir=ssd_dir) as cluster, \
            distributed.Client(cluster) as client:
        stats = dmdask.stats(client)
        for worker in stats["workers"].values():  # known from the start, before any block
            assert ssd_dir in worker["ssd"]["error"] and reason in worker["ssd"]["error"]
        assert stats["total"]["ssd"]["error"] == worker["ssd"]["error"]  # the same reason, once
        assert stats["total"]["ram"]["error"] is None
        ids = all_ids(run_epoch(client, dmdask.Spec(path, batch_size=32), world_size=2))
        assert np.array_equal(np.sort(ids), np.arange(400))
        total = dmdask.stats(client)["total"]
        assert total["ssd"]["blocks"] == 0 and total["streamed_blocks"] == 8


def test_usable_ssd_dir_has_no_error(tmp_path):
    path = write_zarr(str(tmp_path / "d.zarr"), 400, chunk=50)
    with dmdask.LocalCluster(n_workers=1, ram=0, ssd="1 MiB", ssd_dir=str(tmp_path / "ssd")) as cluster, \
            distributed.Client(cluster) as client:
        ids = all_ids(run_epoch(client, dmdask.Spec(path, batch_size=32)))
        assert np.array_equal(np.sort(ids), np.arange(400))
        total = dmdask.stats(client)["total"]
        assert total["ssd"]["error"] is None and total["ssd"]["blocks"] == 8


def test_unusable_ssd_folder_is_logged_and_closes_the_tier(tmp_path, caplog):
    blocker = tmp_path / "ssd-file"
    blocker.write_bytes(b"x")
    assert TieredStore(ram=0, ssd=0, ssd_dir=str(blocker)).open_ssd() is None  # no SSD tier wanted
    store = TieredStore(ram=0, ssd=10_000, ssd_dir=str(blocker))
    with caplog.at_level(logging.WARNING, logger="dmdask.worker.tiers"):
        reason = store.open_ssd()
    assert str(blocker) in reason and store.stats()["ssd"]["error"] == reason
    assert any(reason in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert store.reserve(100) is None  # its blocks are streamed

    # a folder that becomes unusable only when the first block is written: the same
    later = tmp_path / "later"
    store = TieredStore(ram=0, ssd=10_000, ssd_dir=str(later))
    later.write_bytes(b"x")
    assert store.reserve(100) == "ssd"
    block = Block({"x": zarr_sample(np.arange(4))}, 0, 4)
    with caplog.at_level(logging.WARNING, logger="dmdask.worker.tiers"):
        assert store.place("dmdask-block-t-0", "ssd", block, 100) is None
    assert str(later) in store.stats()["ssd"]["error"]
    assert store.ssd.reserved == 0 and store.reserve(100) is None
    assert sum(str(later) in r.getMessage() for r in caplog.records) == 1


def keep(batch):
    """An identity transform: batches are then assembled by a worker (`dmdask_batch`)."""
    return batch


@pytest.fixture
def http_store(tmp_path):
    """A dataset of 8 blocks (50 samples each) served by a counting HTTP store."""
    root = tmp_path / "pfs"
    write_zarr(str(root / "d.zarr"), 400, chunk=50)
    with StoreServer(str(root)) as server:
        yield server, root


def chunk_requests(server, block):
    """GETs of each chunk file of the dataset, by block ("x" and "label" chunks)."""
    by_path = server.stats()["by_path"]
    return {p: v["requests"] for p, v in by_path.items() if p in (f"d.zarr/x/c/{block}/0", f"d.zarr/label/c/{block}")}


def all_chunk_requests(server):
    return {p: v["requests"] for p, v in server.stats()["by_path"].items() if "/c/" in p}


@pytest.mark.parametrize("path, how", [("worker", "deleted"), ("mapped", "deleted"), ("worker", "replaced"),
                                       ("mapped", "replaced")])
def test_ssd_block_whose_files_vanish_is_read_again_once(tmp_path, http_store, path, how):
    """An SSD block's files deleted between epochs: the next epoch still delivers every
    sample once, the block is read again from the store exactly once (and put back on
    the SSD), and the drop is counted. "worker": rows taken by the workers (a
    transform), ranks and requests concurrent; "mapped": after an epoch with a
    transform, the training process maps the SSD files itself; the deleted block's
    rows then come through the row channel. "replaced": a file of the block overwritten
    with 400 bytes of garbage (its size no longer matches the block's layout) is treated
    as gone the same way, never reshaped into a raw ValueError."""
    server, _ = http_store
    ssd = tmp_path / "ssd"
    with dmdask.LocalCluster(n_workers=2, ram=0, ssd="1 MiB", ssd_dir=str(ssd)) as cluster, \
            distributed.Client(cluster) as client:
        spec = dmdask.Spec(server.url + "/d.zarr", batch_size=32, transform=keep)
        ids = all_ids(run_epoch(client, spec, epoch=0, world_size=2))
        assert np.array_equal(np.sort(ids), np.arange(400))
        first = all_chunk_requests(server)
        assert len(first) == 16 and set(first.values()) == {1}
        assert dmdask.stats(client)["total"]["ssd"]["blocks"] == 8

        (victim,) = ssd.glob("dmdask-ssd-*/b150-*")  # block 3: samples 150..199
        if how == "deleted":
            shutil.rmtree(victim)
        else:
            (victim / "x").write_bytes(os.urandom(400))
        concurrent = path == "worker"  # requests for the block at once: still read once
        if path == "mapped":  # one request at a time: no retry of one can help another
            spec = spec.replace(transform=None, prefetch=1)
        for epoch in (1, 2):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=2, concurrent_ranks=concurrent)
            ids = all_ids(per_rank)
            assert np.array_equal(np.sort(ids), np.arange(400))
            for batches in per_rank:
                for b in batches:
                    np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]))
        after = all_chunk_requests(server)
        assert chunk_requests(server, 3) == {"d.zarr/x/c/3/0": 2, "d.zarr/label/c/3": 2}
        assert {p: n for p, n in after.items() if n != 1} == chunk_requests(server, 3)
        total = dmdask.stats(client)["total"]
        assert total["ssd"]["read_errors"] == 1
        assert total["ssd"]["blocks"] == 8  # back on the SSD
        assert total["shared_store"]["requests"] == 9
        assert not victim.exists()


def store_totals(client):
    return dmdask.stats(client)["total"]["shared_store"]


def test_transient_store_errors_are_retried(tmp_path):
    """Every chunk file answers 503 twice before it is served: the epoch delivers every
    sample once, each failed answer was one retry, and each block counts one read."""
    root = tmp_path / "pfs"
    write_zarr(str(root / "d.zarr"), 400, chunk=50)
    with StoreServer(str(root)) as server, dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, \
            distributed.Client(cluster) as client:
        server.fail_first(2, "d.zarr/*/c/*")
        per_rank = run_epoch(client, dmdask.Spec(server.url + "/d.zarr", batch_size=32), world_size=2)
        ids = all_ids(per_rank)
        assert np.array_equal(np.sort(ids), np.arange(400))
        for b in (b for batches in per_rank for b in batches):
            np.testing.assert_array_equal(b["x"], zarr_sample(b["index"]))
        chunks = all_chunk_requests(server)
        assert len(chunks) == 16 and min(chunks.values()) >= 3  # 2 refused, then served
        assert server.stats()["failed"] == 32
        assert store_totals(client) == {"requests": 8, "bytes": 400 * 40, "retries": 32, "read_ahead": 0, "from_ranks": 0}


def test_transient_errors_of_row_reads_are_retried(tmp_path):
    """A folder's files read as ranks ask (one row read per request): each file answers
    503 once; every row read is retried once and every file is fetched twice."""
    root = tmp_path / "pfs"
    write_folder(str(root / "files"), classes=2, per_class=30)
    with StoreServer(str(root)) as server, dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, \
            distributed.Client(cluster) as client:
        server.fail_first(1, "files/*/*.bin")
        per_rank = run_epoch(client, dmdask.Spec(server.url + "/files", batch_size=8, block_size=10), world_size=2)
        ids = all_ids(per_rank)
        assert np.array_equal(np.sort(ids), np.arange(60))
        for b in (b for batches in per_rank for b in batches):
            assert [bytes(d) for d in b["data"]] == [folder_sample(i) for i in b["index"]]
        files = {p: v["requests"] for p, v in server.stats()["by_path"].items() if p.endswith(".bin")}
        assert len(files) == 60 and set(files.values()) == {2}
        totals = store_totals(client)
        assert server.stats()["failed"] == 60 and totals["retries"] == totals["requests"] > 0


def test_missing_file_fails_at_once_naming_the_url(tmp_path):
    """A 404 is permanent: no retry, a BlockReadError naming the URL and the samples."""
    root = tmp_path / "pfs"
    write_folder(str(root / "files"), classes=2, per_class=10)
    with StoreServer(str(root)) as server, dmdask.LocalCluster(n_workers=1, ram=0) as cluster, \
            distributed.Client(cluster) as client:
        url = server.url + "/files"
        # prefetch=1: one batch a request, so a failed batch is not asked for again alone
        it = dmdask.batches(client, dmdask.Spec(url, batch_size=5, block_size=5, shuffle=False, prefetch=1))
        os.remove(root / "files" / "class-01" / "s-00000013.bin")
        assert [next(it)["index"].tolist() for _ in range(2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        with pytest.raises(dmdask.BlockReadError) as info:
            next(it)
        message = str(info.value)
        assert url in message and "samples 10..14" in message and "FileNotFoundError" in message
        assert "tries" not in message
        assert server.stats()["by_path"]["files/class-01/s-00000013.bin"]["requests"] == 1
        assert store_totals(client)["retries"] == 0


def test_store_errors_that_outlast_the_retry_time_fail_naming_the_url(tmp_path):
    root = tmp_path / "pfs"
    write_zarr(str(root / "d.zarr"), 100, chunk=50)
    with dask.config.set({"dmdask.store.retry-seconds": 0.5}), StoreServer(str(root)) as server, \
            dmdask.LocalCluster(n_workers=1, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        server.fail_first(1000, "d.zarr/*/c/1*")  # block 1 keeps failing, block 0 is fine
        url = server.url + "/d.zarr"
        delivered = []
        with pytest.raises(dmdask.BlockReadError) as info:
            for b in dmdask.batches(client, dmdask.Spec(url, batch_size=25, shuffle=False)):
                delivered.append(b["index"])
        assert np.array_equal(np.concatenate(delivered), np.arange(50))
        message = str(info.value)
        assert url in message and "samples 50..99" in message and "tries in" in message and "503" in message
        retries = store_totals(client)["retries"]
        assert retries >= 1 and server.stats()["failed"] == retries + 1  # the last one was not retried


def test_refused_connection_is_retried_until_the_store_is_back(tmp_path):
    """A real refused connection (the store is down), then the store comes back on the
    same port within the retry time: the read succeeds."""
    from dmdask.source import open_source

    write_folder(str(tmp_path / "files"), classes=1, per_class=4)
    server = StoreServer(str(tmp_path)).start()
    port = int(server.url.rsplit(":", 1)[1])
    reader = open_source(dmdask.Spec(server.url + "/files", batch_size=2)).reader(0)
    server.stop()
    retries = []
    back = threading.Timer(0.5, lambda: StoreServer(str(tmp_path), port=port).start())
    back.start()
    try:
        arrays = reader.read(on_retry=retries.append)
    finally:
        back.join()
    assert [bytes(d) for d in arrays["data"]] == [folder_sample(i) for i in range(4)]
    assert retries and all(dmdask.source.base.is_transient(e) for e in retries)


@pytest.mark.parametrize("exc,transient", [
    (ConnectionRefusedError(111, "refused"), True),
    (ConnectionResetError(104, "reset"), True),
    (TimeoutError("timed out"), True),
    (OSError(errno.ETIMEDOUT, "timed out"), True),
    (FileNotFoundError(2, "gone"), False),
    (PermissionError(13, "denied"), False),
    (ValueError("cannot decode"), False),
    (RuntimeError("blosc error"), False),
])
def test_transient_errors_are_told_from_permanent_ones(exc, transient):
    from dmdask.source.base import is_transient

    assert is_transient(exc) is transient
    wrapped = RuntimeError("zarr wrapped it")
    wrapped.__cause__ = exc
    assert is_transient(wrapped) is transient


@pytest.mark.parametrize("status,transient", [(500, True), (502, True), (503, True), (429, True), (404, False),
                                              (403, False)])
def test_http_statuses(status, transient):
    import aiohttp

    from dmdask.source.base import is_transient

    exc = aiohttp.ClientResponseError(None, (), status=status, message="x")
    assert is_transient(exc) is transient
    assert is_transient(aiohttp.ServerDisconnectedError()) and not is_transient(
        aiohttp.ClientSSLError(None, OSError(1, "certificate verify failed")))


def tampered(state, path, value):
    """A copy of `state` with the value at `path` (keys and indices) replaced."""
    import copy

    out = copy.deepcopy(state)
    target = out
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return out


@pytest.mark.parametrize("path, value, field", [
    (("history", 0, "consumed", 0), -5, "resume['history'][0]['consumed'][0]"),
    (("history", 0, "consumed", 1), 10**9, "resume['history'][0]['consumed'][1]"),
    (("history", 0, "world_size"), 0, "resume['history'][0]['world_size']"),
    (("history", 0, "world_size"), 10**9, "resume['history'][0]['world_size']"),
    (("history", 0, "world_size"), "2", "resume['history'][0]['world_size']"),
    (("history", 0), "a generation", "resume['history'][0]"),
    (("history",), "none", "resume['history']"),
    (("world_size",), 0, "resume['world_size']"),
    (("world_size",), "1", "resume['world_size']"),
    (("rank",), 10**9, "resume['rank']"),
    (("rank",), -1, "resume['rank']"),
    (("batch_size",), 0, "resume['batch_size']"),
    (("position",), "3", "resume['position']"),
    (("position",), 10**9, "resume"),
    (("epoch",), -1, "resume['epoch']"),
    (("shuffle_window",), 0, "resume['shuffle_window']"),
    (("surprise",), 1, "resume['surprise']"),
])
def test_a_tampered_resume_state_is_a_spec_error_naming_the_field(client, tmp_path, path, value, field):
    """States edited into what no iterator writes (the list of every rank's, resumed
    elastically, has a `history`) are refused with `SpecError` naming the field, never an
    IndexError, ValueError or TypeError from inside."""
    source = str(tmp_path / "d.zarr")
    write_zarr(source, 200, chunk=20)
    spec = dmdask.Spec(source, batch_size=10, world_size=2, seed=3)
    states = []
    for rank in range(2):
        it = dmdask.batches(client, spec.replace(rank=rank), epoch=0)
        for _ in range(2 + rank):
            next(it)
        states.append(it.state_dict())
    one = spec.replace(world_size=1, rank=0)
    resumed = dmdask.batches(client, one, epoch=0, resume=states)  # elastic: 2 ranks -> 1
    next(resumed)
    state = resumed.state_dict()
    assert state["history"]
    rest = [b["index"] for b in dmdask.batches(client, one, epoch=0, resume=state)]  # untouched: resumes
    assert len(np.concatenate(rest)) == 200 - 10 * 5 - 10
    with pytest.raises(dmdask.SpecError) as info:
        dmdask.batches(client, one, epoch=0, resume=tampered(state, path, value))
    assert str(info.value).startswith(field + "="), str(info.value)


def test_an_arena_file_seen_mid_write_gives_whole_rows(tmp_path):
    """The corrupt-chunk race: a worker writing a block into a new slot of its arena
    makes the file grow a page at a time, so a reader mapping it meanwhile may see a size
    that is no multiple of a row (rows of 48 float32 = 192 bytes here). The reader maps
    the whole rows, and the slot's labels say which of them hold data (never a raw
    "cannot reshape" ValueError)."""
    from dmdask.shm.arena import ID_FIELD, Arena, ArenaMaps
    from dmdask.worker.holdings import Block

    folder = tmp_path / "shm"
    folder.mkdir()

    def block(k, n=1194):
        ids = np.arange(k * n, (k + 1) * n)
        return Block({"x": zarr_sample(ids, (48,))}, int(ids[0]), int(ids[-1]) + 1)

    arena = Arena(str(folder), "ds", 1194, block(0))
    assert arena.write(block(0)) == 0
    path, dtype, shape = arena.fields["x"]
    os.truncate(path, 14 * 4096)  # what a reader sees while slot 1 is being written: 57344 bytes
    rows = ArenaMaps().rows(path, dtype, shape, 100)
    assert rows.shape == (57344 // 192, 48)
    np.testing.assert_array_equal(rows[:100], zarr_sample(np.arange(100), (48,)))
    # and with a writer really extending the file while readers map it
    done = threading.Event()
    seen = []

    def read():
        while not done.is_set():
            maps = ArenaMaps()
            got = maps.rows(path, dtype, shape, 1)
            labels = maps.rows(*arena.fields[ID_FIELD], 1)
            seen.append((len(got), len(labels)))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for k in range(1, 40):
            assert arena.write(block(k)) == k
    finally:
        done.set()
        reader.join()
    arena.close()
    assert seen


@pytest.mark.skipif(not can_mount(), reason="mounting a small tmpfs needs root")
def test_a_ram_tier_larger_than_shared_memory_warns_once_and_shows_on_status(tmp_path, capfd):
    """A 20 MiB tmpfs as shm-dir under ram=64 MiB: each worker warns once at start with
    both sizes, logs its one line of tiers, and `dmdask status` and the dashboard's JSON show it."""
    import json
    import sys
    import urllib.request

    shm = tmp_path / "small-shm"
    shm.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(shm)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with dmdask.LocalCluster(n_workers=1, ram="64 MiB", shm_dir=str(shm), silence_logs=logging.INFO) as cluster, \
                distributed.Client(cluster) as client:
            warning = dmdask.stats(client)["total"]["ram"]["warning"]
            assert "64.00 MiB" in warning and "20.00 MiB free" in warning and str(shm) in warning
            done = subprocess.run([sys.executable, "-m", "dmdask.cli", "status", cluster.scheduler_address],
                                  capture_output=True, text=True, timeout=60,
                                  env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))))
            assert done.returncode == 0, done.stderr
            assert "ram warning: the RAM tier (64.00 MiB) does not fit" in done.stdout
            url = client.dashboard_link.rsplit("/", 1)[0] + "/dmdask/tiers.json"
            snap = json.load(urllib.request.urlopen(url, timeout=30))
            assert "does not fit" in snap["total"]["ram"]["warning"]
        err = capfd.readouterr().err
        assert err.count("does not fit in") == 1, err
        assert err.count("dmdask tiers: RAM 64.00 MiB in") == 1, err
    finally:
        subprocess.run(["umount", "-l", str(shm)])


def _double(batch):
    return {**batch, "x": batch["x"] * 2}


@pytest.mark.skipif(not can_mount(), reason="mounting a small tmpfs needs root")
def test_a_full_shared_memory_folder_sends_transformed_batches_through_the_connection(tmp_path, capfd):
    """The worker's shared-memory folder (a 4 MiB tmpfs) is filled to the last byte before an
    epoch with a transform: the batches come through the rank's connection instead of the
    folder, every sample once and transformed, and the worker says so once (the write's
    ENOSPC once was taken for a lost worker: every batch retried in a process of its own
    until the rank's deadline)."""
    shm = tmp_path / "small-shm"
    shm.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(shm)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        path = write_zarr(str(tmp_path / "d.zarr"), 400, chunk=50)
        with dmdask.LocalCluster(n_workers=1, ram="64 MiB", shm_dir=str(shm), dashboard_address=None) as cluster, \
                distributed.Client(cluster) as client, dask.config.set({"dmdask.client.recovery-seconds": 20}):
            with open(shm / "filler", "wb", buffering=0) as f:
                with pytest.raises(OSError) as full:
                    while True:
                        f.write(b"\0" * 4096)
            assert full.value.errno == errno.ENOSPC
            got = list(dmdask.batches(client, dmdask.Spec(path, batch_size=50, transform=_double)))
            ids = np.concatenate([b["index"] for b in got])
            assert sorted(ids.tolist()) == list(range(400))
            np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), 2 * zarr_sample(ids))
        assert capfd.readouterr().err.count("is full") == 1
    finally:
        subprocess.run(["umount", "-l", str(shm)])
