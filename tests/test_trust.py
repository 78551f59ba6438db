"""Who may read what: the modes of the workers' files, the sources workers read for
clients (`dmdask.worker.allowed-sources`), and handlers that refuse bad arguments."""
import os
import shutil
import stat
import subprocess
import tempfile
import time

import dask
import distributed
import numpy as np
import pytest

import dmdask
from dmdask.protocol.rows import RowChannels, RowsAsked
from dmdask.protocol.worker import BatchRequest, DescribeRequest, Moved, WorkerAPI, to_wire
from dmdask.spec import TransformContext
from dmdask.testing.datasets import write_folder, write_tar_shards, write_zarr


@pytest.fixture
def open_root():
    """A folder every local user may enter, as /dev/shm is."""
    path = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="dmdask-test-")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def worker_entries(root):
    """(folders, files) under the workers' tier folders in `root`."""
    folders, files = [], []
    for tier in ("shm", "ssd"):
        for top, dirs, names in os.walk(os.path.join(root, tier)):
            folders += [os.path.join(top, d) for d in dirs]
            files += [os.path.join(top, n) for n in names]
    return folders, files


def read_both(client, zarr_path, folder_path):
    n = 0
    for spec in (dmdask.Spec(zarr_path, batch_size=50), dmdask.Spec(folder_path, batch_size=50, block_size=50)):
        n += sum(len(b["index"]) for b in dmdask.batches(client, spec))
    return n


def as_nobody(*command):
    return subprocess.run(list(command), user="nobody", capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0, reason="reads as user nobody need root")
def test_tier_files_are_the_workers_users_only_under_the_default_umask(open_root, tmp_path):
    """Under umask 022, every folder of the RAM (shared memory) and SSD tiers is 0700 and
    every file 0600: another user of the node (nobody) finds nothing of the dataset."""
    zarr_path = write_zarr(str(tmp_path / "d.zarr"), 300, chunk=50)
    folder_path = write_folder(str(tmp_path / "folder"), classes=3, per_class=100)
    old = os.umask(0o022)
    try:
        with dmdask.LocalCluster(n_workers=1, ram="64 KiB", ssd="64 MiB", shm_dir=os.path.join(open_root, "shm"),
                                 ssd_dir=os.path.join(open_root, "ssd")) as cluster, \
                distributed.Client(cluster) as client:
            assert read_both(client, zarr_path, folder_path) == 600
            stats = dmdask.stats(client)["total"]
            assert stats["ram"]["blocks"] and stats["ssd"]["blocks"]
            folders, files = worker_entries(open_root)
            assert any("/shm/" in f for f in files) and any("/ssd/" in f for f in files), files
            for path in folders:
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
            for path in files:
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
            assert subprocess.run(["grep", "-rl", "sample-0000", open_root], capture_output=True).stdout
            found = as_nobody("grep", "-rl", "sample-0000", open_root)
            assert found.stdout == "" and "Permission denied" in found.stderr
            assert as_nobody("cat", files[0]).returncode != 0
            # the training process (the worker's user) still maps them: a warm epoch from files
            assert read_both(client, zarr_path, folder_path) == 600
    finally:
        os.umask(old)


def test_a_configured_group_may_read_the_tier_files(open_root, tmp_path):
    """`dmdask.worker.group`: folders 2750 and files 0640 of that group, even under umask 077."""
    zarr_path = write_zarr(str(tmp_path / "d.zarr"), 300, chunk=50)
    folder_path = write_folder(str(tmp_path / "folder"), classes=3, per_class=100)
    gid = os.getgid()
    old = os.umask(0o077)
    try:
        with dask.config.set({"dmdask.worker.group": str(gid)}), \
                dmdask.LocalCluster(n_workers=1, ram="64 KiB", ssd="64 MiB", shm_dir=os.path.join(open_root, "shm"),
                                    ssd_dir=os.path.join(open_root, "ssd")) as cluster, \
                distributed.Client(cluster) as client:
            assert read_both(client, zarr_path, folder_path) == 600
            folders, files = worker_entries(open_root)
            assert files
            for path in folders:
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o2750 and os.stat(path).st_gid == gid, path
            for path in files:
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o640 and os.stat(path).st_gid == gid, path
    finally:
        os.umask(old)


def test_an_unknown_group_is_a_clear_error():
    from dmdask.shm.modes import group_id

    with pytest.raises(dmdask.SpecError, match="dmdask.worker.group"):
        group_id("no-such-group-here")


@pytest.fixture(scope="module")
def allowed_cluster(tmp_path_factory):
    """Workers that read only sources under `allowed/`."""
    root = tmp_path_factory.mktemp("sources")
    os.makedirs(root / "allowed")
    with dask.config.set({"dmdask.worker.allowed-sources": [str(root / "allowed")]}):  # the workers' config only
        cluster = dmdask.LocalCluster(n_workers=2, ram="16 MiB", dashboard_address=":0")
    with cluster, distributed.Client(cluster) as client:
        yield root, client


def test_workers_read_only_the_allowed_sources(allowed_cluster):
    root, client = allowed_cluster
    inside = write_zarr(str(root / "allowed" / "in.zarr"), 200, chunk=50)
    outside = write_zarr(str(root / "allowed-not" / "out.zarr"), 200, chunk=50)  # a string prefix, not a folder
    assert sum(len(b["index"]) for b in dmdask.batches(client, dmdask.Spec(inside, batch_size=50))) == 200
    for source in (outside, str(root / "allowed" / ".." / "allowed-not" / "out.zarr")):
        with pytest.raises(dmdask.SourceNotAllowedError) as info:
            list(dmdask.batches(client, dmdask.Spec(source, batch_size=50)))
        assert isinstance(info.value, ValueError)
        assert str(root / "allowed") in str(info.value) and "allowed-sources" in str(info.value)
    assert dmdask.stats(client)["total"]["shared_store"]["bytes"] == 200 * (8 * 4 + 8)  # nothing read outside


def test_every_url_of_a_listed_source_must_be_allowed(allowed_cluster):
    """A list of files or shards is checked URL by URL: one outside the prefixes refuses its
    block, though the list's first URL is inside."""
    root, client = allowed_cluster
    files = write_folder(str(root / "allowed" / "images"), classes=1, per_class=4)
    inside = [f"{files}/class-00/s-{i:08d}.bin" for i in range(4)]
    outside = f"{write_folder(str(root / 'elsewhere'), classes=1, per_class=1)}/class-00/s-00000000.bin"
    shards = write_tar_shards(str(root / "allowed" / "shards"), shards=1, per_shard=4)
    other = write_tar_shards(str(root / "elsewhere-shards"), shards=1, per_shard=4)
    before = dmdask.stats(client)["total"]["shared_store"]["bytes"]
    for urls in (inside + [outside], shards + other):
        with pytest.raises(dmdask.SourceNotAllowedError, match="allowed-sources"):
            list(dmdask.batches(client, dmdask.Spec(urls, batch_size=8)))
    assert dmdask.stats(client)["total"]["shared_store"]["bytes"] == before  # nothing read
    got = np.concatenate([b["index"] for b in dmdask.batches(client, dmdask.Spec(inside, batch_size=8))])
    assert sorted(got.tolist()) == [0, 1, 2, 3]


def test_transparent_reads_are_held_to_the_allowed_sources(allowed_cluster):
    """A `dmdask::` read of a file outside the prefixes: the reader's own read is its
    own business, but no worker loads the file (nor takes it handed over)."""
    import fsspec

    import dmdask.fs

    root, client = allowed_cluster
    secret = root / "secret.bin"
    secret.write_bytes(b"not for the workers" * 100)
    before = dmdask.stats(client)["total"]
    try:
        for _ in range(2):
            with fsspec.open(f"dmdask::file://{secret}", "rb") as f:
                assert f.read() == secret.read_bytes()  # read by this process itself, with its own rights
    finally:
        dmdask.fs.close()
    after = dmdask.stats(client)["total"]
    assert after["shared_store"] == before["shared_store"]
    assert after["ram"]["blocks"] == before["ram"]["blocks"]


@pytest.fixture(scope="module")
def plain_cluster():
    with dmdask.LocalCluster(n_workers=1, ram="16 MiB", dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        yield client


def refused(client, call, /, *args, **msg):
    with pytest.raises(dmdask.HandlerArgumentError) as info:
        client.sync(call, *args, **msg)
    return str(info.value)


def test_worker_handlers_refuse_bad_arguments_and_change_nothing(plain_cluster, tmp_path):
    client = plain_cluster
    path = write_zarr(str(tmp_path / "d.zarr"), 100, chunk=50)
    assert sum(len(b["index"]) for b in dmdask.batches(client, dmdask.Spec(path, batch_size=50))) == 100
    before = dmdask.stats(client)["total"]
    address = next(iter(client.scheduler_info()["workers"]))
    worker, api = client.rpc(address), WorkerAPI(client.rpc)
    message = refused(client, api.count_hits, address, {"ram": [-999_999_999_999, 0]})
    assert "dmdask_count_hits" in message and "hits['ram'] samples" in message and ">= 0" in message
    assert "unknown: ['gpu']" in refused(client, api.count_hits, address, {"ram": [1, 1], "gpu": [1, 1]})
    refused(client, api.count_hits, address, {"ram": [1, 1], "ssd": ["many", 1]})  # nothing of it counted
    refused(client, api.count_hits, address, {"ram": [1.5, 1]})
    assert "hits=(1, 2)" in refused(client, api.count_hits, address, [1, 2])
    assert "keys=" in refused(client, api.describe, address, "dmdask-block-x-0")
    # the row channel: a bad request is answered with the error naming the field, then closed
    channels, none = RowChannels(api, None, 30), np.zeros(0, np.int64)
    for asked, name in ((RowsAsked("dmdask-block-x-0", none.astype(np.int32), none), "keys="),
                        (RowsAsked(["k", "k"], none.astype(np.int32), none), "keys="),
                        (RowsAsked(["k"], none.astype(np.int32), none, wait=60), "wait="),
                        (RowsAsked(["k"], none.astype(np.int32), none, priority=-1), "priority="),
                        (RowsAsked(["k"], np.array([1], np.int32), np.array([0])), "blocks=")):
        message = refused(client, channels.fetch, None, address, asked)
        assert message.startswith(f"dmdask row channel: {name}"), message
    # a message that is not a typed request (the dicts of before), or with unknown fields
    assert "message=None" in refused(client, worker.dmdask_describe, msg={"dmdask-block-x-0": [0]})
    wire = to_wire(DescribeRequest(["dmdask-block-x-0"]))
    assert "arguments" in refused(client, worker.dmdask_describe, **wire, nonsense=1)
    assert "DescribeRequest" in refused(client, worker.dmdask_batch, **wire)
    good_batch = {"requests": {}, "positions": {}, "index": np.arange(2), "sizes": [2], "fields": ["x"]}
    for bad, name in (({"sizes": [3]}, "sizes"), ({"sizes": [-1, 3]}, "sizes"), ({"fields": "x"}, "fields"),
                      ({"transform": "code"}, "transform"), ({"requests": {"tcp://a:1": {}}}, "positions"),
                      ({"context": TransformContext(-1, 0)}, "context.epoch"), ({"wait": -1}, "wait"),
                      ({"requests": {"tcp://a:1": {}}, "positions": {"tcp://a:1": np.array([0, 5])}},
                       "positions['tcp://a:1']")):
        message = refused(client, api.call, address, BatchRequest(**{**good_batch, **bad}))
        assert message.startswith(f"dmdask_batch: {name}="), message
    after = dmdask.stats(client)["total"]
    assert after["ram"]["hits"] == before["ram"]["hits"] and after["ssd"]["hits"] == before["ssd"]["hits"]
    client.sync(api.count_hits, address, {"ram": [2, 16]})  # a good report still counts
    assert dmdask.stats(client)["total"]["ram"]["hits"] == before["ram"]["hits"] + 2


def _digest_in_new_process(url: str, scheduler: str) -> str:
    """sha1 of a file read whole through `dmdask::` by a new process (a run of its own)."""
    import sys

    code = ("import fsspec, hashlib, distributed, dmdask\n"
            f"with distributed.Client({scheduler!r}):\n"
            f"    print(hashlib.sha1(fsspec.open({url!r}).open().read()).hexdigest())\n")
    env = {k: v for k, v in os.environ.items() if k != "DMDASK_FS_RUN"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240,
                         check=True)
    return out.stdout.strip()


def test_bytes_handed_over_by_another_client_are_never_served(tmp_path):
    """A client that computes a block's key sends its own bytes to `dmdask_hand_over` on every
    worker; readers in new processes must still get the store's bytes, the first (whose
    load takes only what it handed over itself) and the next (served from the cache)."""
    import hashlib

    import fsspec

    from benchmarks.store_server import StoreServer

    (tmp_path / "data.bin").write_bytes(b"s" * 5000)
    with StoreServer(str(tmp_path)) as store, \
            dmdask.LocalCluster(n_workers=2, ram="16 MiB", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        url = store.url + "/data.bin"
        fs, path = fsspec.core.url_to_fs("dmdask::" + url)
        key = fs.source(path, fsspec.filesystem("http").info(url)).reader(0).key  # what an attacker can compute
        poison = {key: b"p" * 5000}
        api = WorkerAPI(client.rpc)
        for worker in client.scheduler_info()["workers"]:
            assert set(client.sync(api.hand_over, worker, poison, "made-up")) <= {key}  # kept for that claim only
        truth = hashlib.sha1(b"s" * 5000).hexdigest()
        assert _digest_in_new_process("dmdask::" + url, cluster.scheduler_address) == truth
        assert _digest_in_new_process("dmdask::" + url, cluster.scheduler_address) == truth  # from the cache
        with pytest.raises(dmdask.HandlerArgumentError, match="claim"):
            client.sync(api.hand_over, next(iter(client.scheduler_info()["workers"])), poison, None)


def _epoch(client, spec):
    """(sample ids, x rows) of one epoch, in delivery order."""
    got = list(dmdask.batches(client, spec))
    return np.concatenate([b["index"] for b in got]), np.concatenate([b["x"] for b in got])


def test_a_client_cannot_put_its_rows_under_another_clients_dataset(tmp_path):
    """An attacker that reads its own dataset (x = 666) registers its info under the victim's
    name (one handler call, or a claim and a registration), then releases the victim's
    dataset: every call is refused, and the victim's epochs get the store's rows, once each,
    read from the store once."""
    import dataclasses

    import zarr

    from dmdask.protocol.scheduler import Abandon, Claimed, GetOrClaim, GetOrRegister, Ready, Register, SchedulerAPI
    from dmdask.source import dataset_name
    from dmdask.testing.datasets import zarr_sample

    victim_spec = dmdask.Spec(write_zarr(str(tmp_path / "victim.zarr"), 200, chunk=50), batch_size=50)
    evil = write_zarr(str(tmp_path / "evil.zarr"), 200, chunk=50)
    zarr.open_group(evil, mode="r+")["x"][:] = 666.0
    evil_spec, name = dmdask.Spec(evil, batch_size=50), dataset_name(victim_spec)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as attacker, distributed.Client(cluster) as victim:
        assert (_epoch(attacker, evil_spec)[1] == 666.0).all()  # its blocks are in the cluster
        api = SchedulerAPI(attacker)
        own = attacker.sync(api.send, GetOrClaim(dataset_name(evil_spec), "attacker"))
        assert isinstance(own, Ready)
        forged = dataclasses.replace(own.info, name=name)
        with pytest.raises(dmdask.HandlerArgumentError, match="dmdask_get_or_register: info.identity="):
            attacker.sync(api.send, GetOrRegister(forged))
        assert attacker.sync(api.send, GetOrClaim(name, "attacker")) == Claimed()
        for info, field in ((forged, "info.identity"), (own.info, "info.name")):
            with pytest.raises(dmdask.HandlerArgumentError, match=f"dmdask_register: {field}="):
                attacker.sync(api.send, Register(name, "attacker", info))
        attacker.sync(api.send, Abandon(name, "attacker"))
        before = dmdask.stats(victim)["total"]["shared_store"]["bytes"]
        for epoch in range(2):
            ids, x = _epoch(victim, victim_spec)
            assert sorted(ids.tolist()) == list(range(200))
            np.testing.assert_array_equal(x, zarr_sample(ids))
            if epoch == 0:  # a client that does not hold it cannot drop it under the victim
                with pytest.raises(dmdask.DatasetHeldError, match="other clients"):
                    dmdask.release(attacker, victim_spec)
                with pytest.raises(dmdask.HandlerArgumentError, match="info.identity="):
                    attacker.sync(api.send, GetOrRegister(forged))
        assert dmdask.stats(victim)["total"]["shared_store"]["bytes"] - before == 200 * (8 * 4 + 8)  # read once
        assert dmdask.release(victim, victim_spec) is True  # its holder may


def test_hit_reports_beyond_their_range_are_refused_and_the_counts_stop_at_their_limit(tmp_path):
    """Three reports of 2**63-1 samples once pushed a counter past 2**64 and the worker shut
    itself down at its next heartbeat (msgpack): each is refused now, and the counts of
    reports within range stop at 2**63-1, the worker alive and counted by `stats`."""
    from dmdask.arguments import REPORT_BYTES, REPORT_SAMPLES
    from dmdask.worker.tier_space import COUNT_MAX

    with dmdask.LocalCluster(n_workers=1, ram="16 MiB", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        address = next(iter(client.scheduler_info()["workers"]))
        api = WorkerAPI(client.rpc)
        for _ in range(3):
            message = refused(client, api.count_hits, address, {"ram": [2 ** 63 - 1, 0]})
            assert f"<= {REPORT_SAMPLES}" in message
        assert f"<= {REPORT_BYTES}" in refused(client, api.count_hits, address, {"ssd": [1, 2 ** 63 - 1]})
        for _ in range(1 + COUNT_MAX // REPORT_BYTES):
            client.sync(api.count_hits, address, {"ram": [REPORT_SAMPLES, REPORT_BYTES]})
        time.sleep(3)  # past a few heartbeats of the worker
        assert list(client.scheduler_info()["workers"]) == [address]  # still there, the same process
        ram = dmdask.stats(client)["total"]["ram"]
        assert ram["hit_bytes"] == COUNT_MAX and ram["hits"] == (1 + COUNT_MAX // REPORT_BYTES) * REPORT_SAMPLES
        path = write_zarr(str(tmp_path / "d.zarr"), 100, chunk=50)
        assert sum(len(b["index"]) for b in dmdask.batches(client, dmdask.Spec(path, batch_size=50))) == 100


def test_no_spelling_of_a_source_leads_workers_out_of_the_allowed_sources(tmp_path):
    """What the filesystem will open is checked, not the URL's text: a query or fragment
    (which `..` once climbed through), percent-encoded `..` and `/` (which the HTTP client or
    the store decodes), symbolic links in an allowed folder (to a Zarr group, a sample file,
    a listed sample file). Each is refused and no worker reads a byte of it; the allowed sources, and a
    link that stays inside, still read."""
    from benchmarks.store_server import StoreServer
    from dmdask.source.urls import opened

    allowed, secret = tmp_path / "allowed", tmp_path / "secret"
    shard = write_tar_shards(str(secret), shards=1, per_shard=4)[0]
    write_tar_shards(str(allowed), shards=1, per_shard=4)
    secret_zarr = write_zarr(str(secret / "s.zarr"), 8, chunk=4)
    write_folder(str(allowed / "images"), classes=1, per_class=4)
    secret_file = f"{write_folder(str(secret / 'images'), classes=1, per_class=1)}/class-00/s-00000000.bin"
    os.symlink(secret_zarr, allowed / "link.zarr")
    os.symlink(shard, allowed / "link.tar")
    linked = allowed / "images" / "class-00" / "s-00000009.bin"
    os.symlink(secret_file, linked)
    os.symlink(allowed / "shard-000000.tar", allowed / "inside.tar")
    assert opened("file://~/x") == os.path.realpath(os.path.expanduser("~/x"))  # as fsspec expands it
    with StoreServer(str(tmp_path)) as store:
        http = store.url
        with dask.config.set({"dmdask.worker.allowed-sources": [f"{http}/allowed", str(allowed)]}):
            cluster = dmdask.LocalCluster(n_workers=1, ram="16 MiB", dashboard_address=None)
        with cluster, distributed.Client(cluster) as client:
            for source in (f"{http}/secret/shard-000000.tar?q=/../../allowed/shard-000000.tar",
                           f"{http}/secret/shard-000000.tar#/../../allowed/shard-000000.tar",
                           f"{http}/allowed/%2e%2e/secret/shard-000000.tar",
                           f"{http}/allowed/..%2Fsecret/shard-000000.tar",
                           str(allowed / "link.zarr"), str(allowed / "link.tar"),
                           (str(allowed / "images" / "class-00" / "s-00000000.bin"), str(linked))):
                with pytest.raises(dmdask.SourceNotAllowedError, match="allowed-sources"):
                    list(dmdask.batches(client, dmdask.Spec(source, batch_size=4, block_size=4)))
                assert dmdask.stats(client)["total"]["shared_store"]["bytes"] == 0, source  # no worker read it
            for source in (f"{http}/allowed/shard-000000.tar", str(allowed / "inside.tar")):
                got = np.concatenate([b["index"] for b in dmdask.batches(client, dmdask.Spec(source, batch_size=4))])
                assert sorted(got.tolist()) == [0, 1, 2, 3]


def test_credentials_in_source_urls_appear_in_no_log_stats_or_error(tmp_path, capfd, caplog):
    """A user and password (`user:password@`) and a presigned query (`?sig=`) in a source's
    URLs: the retries of a store answering 503 (a worker's or this process's, whichever reads)
    log the URL without them, `stats()["datasets"]` names it without them, and so do a `BlockReadError` and a
    `SourceNotFoundError`; the samples still come, once each."""
    from benchmarks.store_server import StoreServer

    write_folder(str(tmp_path / "images"), classes=1, per_class=4)
    with StoreServer(str(tmp_path)) as store, \
            dmdask.LocalCluster(n_workers=1, ram="16 MiB", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        secret_url = store.url.replace("http://", "http://reader:hunter2@")
        urls = tuple(f"{secret_url}/images/class-00/s-{i:08d}.bin?sig=TOPSECRET" for i in range(4))
        store.fail_first(2, "images/*")
        got = np.concatenate([b["index"] for b in dmdask.batches(client, dmdask.Spec(urls, batch_size=4))])
        assert sorted(got.tolist()) == [0, 1, 2, 3]
        assert store.stats()["failed"] > 0  # the worker retried
        logs = capfd.readouterr().err + caplog.text  # the worker processes' and this one's
        assert "transient error reading block 0 of" in logs and store.url in logs
        texts = [logs, repr(dmdask.stats(client)["datasets"])]
        assert f"{store.url}/images/class-00/s-00000000.bin?..." in texts[1]
        store.fail_first(0)
        (tmp_path / "images" / "class-00" / "s-00000002.bin").unlink()
        with pytest.raises(dmdask.BlockReadError) as read:
            list(dmdask.batches(client, dmdask.Spec(urls, batch_size=4, block_size=2)))
        with pytest.raises(dmdask.SourceNotFoundError) as missing:
            list(dmdask.batches(client, dmdask.Spec(f"{secret_url}/nothing.zarr?sig=TOPSECRET", batch_size=4)))
        texts += [str(read.value), read.value.url, str(missing.value)]
        assert store.url in texts[-1]
        for text in texts:
            assert "hunter2" not in text and "TOPSECRET" not in text, text


@pytest.fixture(scope="module")
def two_workers():
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        yield client


def test_a_worker_dials_no_holder_its_scheduler_does_not_know(two_workers):
    """A batch request naming a holder that is not a worker of the cluster (here a socket of
    this test's, listening) answers its blocks as moved before the worker dials anything
    (as for a holder that died: the rank locates them again); the workers' own batches
    still gather from each other."""
    import socket

    client = two_workers
    address = next(iter(client.scheduler_info()["workers"]))
    listening = socket.create_server(("127.0.0.1", 0))
    listening.settimeout(2)
    stranger = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
    try:
        request = BatchRequest(requests={stranger: {"dmdask-block-x-0": np.array([0, 1])}},
                               positions={stranger: np.array([0, 1])}, index=np.arange(2), sizes=[2], fields=["x"])
        with pytest.raises(Moved) as moved:  # the rank locates those blocks again
            client.sync(WorkerAPI(client.rpc).call, address, request)
        assert moved.value.keys == ["dmdask-block-x-0"]
        with pytest.raises(socket.timeout):
            listening.accept()  # nobody dialled it
    finally:
        listening.close()
    path = write_zarr(tempfile.mkdtemp() + "/d.zarr", 100, chunk=50)
    spec = dmdask.Spec(path, batch_size=50, transform=dmdask.per_sample(lambda s: s))  # batches made by a worker
    assert sorted(np.concatenate([b["index"] for b in dmdask.batches(client, spec)]).tolist()) == list(range(100))
