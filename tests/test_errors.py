"""Bad input: a clear error naming what was wrong, and nothing cached is lost."""
import logging
import os
import shutil
import subprocess
import time

import dask
import distributed
import numpy as np
import pytest
import zarr

import dmdask
from dmdask.client.gather import channels_of
from dmdask.protocol.rows import asked_of
from dmdask.source import block_key
from dmdask.testing.datasets import write_folder, write_zarr, zarr_sample

from conftest import all_ids, run_epoch


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_zarr(str(tmp_path_factory.mktemp("good") / "good.zarr"), 500, chunk=50)


def cached_blocks(client):
    return dmdask.stats(client)["total"]["ram"]["blocks"]


def test_missing_source(client, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        dmdask.batches(client, dmdask.Spec(str(tmp_path / "nope.zarr"), batch_size=4))
    assert isinstance(info.value, dmdask.SourceNotFoundError)
    assert "nope.zarr" in str(info.value)


def test_folder_without_class_subfolders(client, tmp_path):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.bin").write_bytes(b"x")
    with pytest.raises(dmdask.SourceError, match="class"):
        dmdask.batches(client, dmdask.Spec(str(tmp_path / "flat"), batch_size=4))


def test_arrays_of_unequal_length(client, tmp_path):
    path = str(tmp_path / "bad.zarr")
    g = zarr.open_group(path, mode="w")
    g.create_array("x", shape=(100, 2), chunks=(10, 2), dtype="f4")
    g.create_array("label", shape=(90,), chunks=(10,), dtype="i8")
    with pytest.raises(ValueError, match=r"first axis.*'x': 100.*'label': 90|first axis.*'label': 90.*'x': 100"):
        dmdask.batches(client, dmdask.Spec(path, batch_size=4))
    # naming arrays of equal length is the documented way out
    batch = next(iter(dmdask.batches(client, dmdask.Spec(path, batch_size=4, keys=["x"]))))
    assert set(batch) == {"x", "index"}


def empty_zarr_group(path):
    g = zarr.open_group(path, mode="w")
    g.create_array("x", shape=(0, 8), chunks=(10, 8), dtype="f4")
    g.create_array("label", shape=(0,), chunks=(10,), dtype="i8")
    return path


def empty_zarr_array(path):
    zarr.open_array(path, mode="w", shape=(0,), chunks=(10,), dtype="i8")
    return path


def empty_folder(path):
    for name in ("class-a", "class-b"):
        os.makedirs(os.path.join(path, name))
    return path


@pytest.mark.parametrize("make", [empty_zarr_group, empty_zarr_array, empty_folder])
def test_empty_dataset_says_it_has_no_samples(client, tmp_path, make):
    path = make(str(tmp_path / "empty-set"))
    spec = dmdask.Spec(path, batch_size=4, rank=1, world_size=2)
    for _ in range(2):  # the failed creation left no claim behind: the next call fails the same way
        with pytest.raises(dmdask.SourceError) as info:
            dmdask.batches(client, spec)
        assert not isinstance(info.value, dmdask.SpecError)  # not a world_size error
        assert f"dataset {path} has no samples" in str(info.value)


@pytest.mark.parametrize("changes,field", [
    ({"keys": ["nope"]}, "keys"),
    ({"block_size": 75}, "block_size"),
    ({"batch_size": 300, "drop_last": True, "world_size": 2}, "batch_size"),
    ({"world_size": 501}, "world_size"),
])
def test_spec_that_does_not_fit_the_source(client, good, changes, field):
    with pytest.raises(dmdask.SpecError) as info:
        dmdask.batches(client, dmdask.Spec(good, **{"batch_size": 10, **changes}))
    assert info.value.field == field


def test_corrupt_chunk_names_url_and_samples_and_keeps_the_cache(client, good, tmp_path):
    for _ in dmdask.batches(client, dmdask.Spec(good, batch_size=50)):
        pass
    before = cached_blocks(client)
    bad = str(tmp_path / "corrupt.zarr")
    write_zarr(bad, 300, chunk=50)
    with open(os.path.join(bad, "x", "c", "2", "0"), "wb") as f:
        f.write(b"this is not a blosc/zstd frame")
    delivered = []
    with pytest.raises(dmdask.BlockReadError) as info:
        for b in dmdask.batches(client, dmdask.Spec(bad, batch_size=25, shuffle=False)):
            delivered.append(b["index"])
    assert np.array_equal(np.concatenate(delivered), np.arange(100))  # every batch before the bad chunk
    message = str(info.value)
    assert "corrupt.zarr" in message and "samples 100..149" in message
    assert isinstance(info.value, OSError)
    # the cluster still serves the good dataset from its cache, nothing was lost
    assert cached_blocks(client) >= before
    ids = all_ids(run_epoch(client, dmdask.Spec(good, batch_size=64), world_size=2))
    assert np.array_equal(np.sort(ids), np.arange(500))
    # a repaired chunk is read again on the next run
    write_zarr(bad, 300, chunk=50)
    batches = list(dmdask.batches(client, dmdask.Spec(bad, batch_size=25, shuffle=False)))
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), zarr_sample(np.arange(300)))


def test_file_vanishing_from_a_streamed_folder(tmp_path):
    """No cache room: blocks are streamed when a batch wants them, so a file removed
    after the listing fails that read, and only that one."""
    root = write_folder(str(tmp_path / "files"), classes=2, per_class=10)
    spec = dmdask.Spec(root, batch_size=5, block_size=5, shuffle=False)
    with dmdask.LocalCluster(n_workers=1, ram=0) as cluster, distributed.Client(cluster) as client:
        it = dmdask.batches(client, spec)
        os.remove(os.path.join(root, "class-01", "s-00000013.bin"))
        assert np.array_equal(next(it)["index"], np.arange(5))
        assert np.array_equal(next(it)["index"], np.arange(5, 10))
        with pytest.raises(dmdask.BlockReadError) as info:
            next(it)
        assert "samples 10..14" in str(info.value) and "files" in str(info.value)
        assert dmdask.stats(client)["total"]["streamed_blocks"] == 4


def can_mount():
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.mark.skipif(not can_mount(), reason="needs root to mount a 1 MiB tmpfs as a small SSD")
def test_full_ssd_stops_growing_and_training_goes_on(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ssd)]).returncode:
        pytest.skip("mount of a tmpfs was refused here (no CAP_SYS_ADMIN)")
    try:
        path = write_zarr(str(tmp_path / "d.zarr"), 4000, sample_shape=(64,), chunk=100)  # ~1.1 MB decoded
        with dmdask.LocalCluster(n_workers=1, ram=0, ssd="100 MiB", ssd_dir=str(ssd)) as cluster, \
                distributed.Client(cluster) as client:
            spec = dmdask.Spec(path, batch_size=128)
            for epoch in range(2):
                ids = all_ids(run_epoch(client, spec, epoch=epoch, world_size=2))
                assert np.array_equal(np.sort(ids), np.arange(4000))
            stats = dmdask.stats(client)["total"]
            assert stats["ssd"]["full"] is True
            assert 0 < stats["ssd"]["blocks"] < 40
            assert stats["ssd"]["bytes"] <= 1024 * 1024
            assert stats["streamed_blocks"] == 40 - stats["ssd"]["blocks"]
            assert stats["ssd"]["hits"] > 0
    finally:
        subprocess.run(["umount", "-l", str(ssd)])


def failing_transform(batch):
    raise OSError("decoder lost its file")  # an OSError must not look like a lost worker


def test_transform_error_surfaces_at_once(client, good, caplog):
    pids = client.run(os.getpid)
    with caplog.at_level(logging.WARNING, logger="dmdask.client.fetch"):
        with pytest.raises(dmdask.TransformError, match="decoder lost its file") as info:
            next(iter(dmdask.batches(client, dmdask.Spec(good, batch_size=10, transform=failing_transform))))
    assert "samples" in str(info.value)
    # not retried as if a worker had died: no retry in a process of its own, every worker as before
    assert "was lost while it ran the transform" not in caplog.text
    assert client.run(os.getpid) == pids


def holdings(client):
    """{block key: the type of what the worker holds under it}, for every worker."""
    def kinds(dask_worker):
        return {k: type(v).__name__ for k, v in dask_worker.data.items() if k.startswith("dmdask-block-")}

    return {k: kind for per_worker in client.run(kinds).values() for k, kind in per_worker.items()}


def ask_rows(client, holder, key, rows):
    """The rows of one block asked of its holder on its row channel: one array per field."""
    return client.sync(channels_of(client).fetch, None, holder, asked_of({key: np.asarray(rows)}))[0]


def store_requests(client):
    return dmdask.stats(client)["total"]["shared_store"]["requests"]


def identity_of(client, url):
    return {d["url"]: d["identity"] for d in dmdask.stats(client)["datasets"]}[url]


def test_rows_request_with_offsets_outside_the_block_is_refused(tmp_path):
    """A raw request on the row channel never gets rows from the block's end for a negative
    offset, nor anything for an offset past it: a ValueError names the block and the
    offsets, whatever the block is held in, and nothing is read from the store."""
    folder = write_folder(str(tmp_path / "files"), classes=2, per_class=10, min_size=16, max_size=16)
    path = write_zarr(str(tmp_path / "d.zarr"), 300, chunk=50)  # 6 blocks of 50 * 40 bytes
    folder_block = 10 * (16 + 8 + 8)
    with dask.config.set({"dmdask.worker.read-ahead": False, "dmdask.client.read-first-batch": False}), \
            dmdask.LocalCluster(n_workers=1, ram=2 * folder_block + 4500, ssd=4500, ssd_dir=str(tmp_path / "ssd")) \
            as cluster, distributed.Client(cluster) as client:
        (holder,) = client.scheduler_info()["workers"]
        # folder blocks bound for RAM fill as ranks ask (not read ahead, nor the first batch
        # read by its rank, here): an iterator that was never advanced created them and read nothing
        dmdask.batches(client, dmdask.Spec(folder, batch_size=5, block_size=10)).close()
        key = block_key(identity_of(client, folder), 1)
        deadline = time.monotonic() + 60
        while sorted(holdings(client).values()) != ["FillingBlock", "FillingBlock"]:
            assert time.monotonic() < deadline, holdings(client)
            time.sleep(0.1)
        with pytest.raises(ValueError, match=rf"{key}.*\[-3, 10\]"):
            ask_rows(client, holder, key, [0, -3, 10])
        assert store_requests(client) == 0  # the good offset 0 was not read for the bad request
        assert ask_rows(client, holder, key, [9, 0])["label"].tolist() == [1, 1]
        assert store_requests(client) == 1

        # Zarr: 2 blocks in the RAM arena, 2 on the SSD, 2 streamed
        ids = all_ids(run_epoch(client, dmdask.Spec(path, batch_size=32)))
        assert np.array_equal(np.sort(ids), np.arange(300))
        identity = identity_of(client, path)
        kinds = {k: v for k, v in holdings(client).items() if identity in k}
        assert sorted(kinds.values()) == ["ArenaBlock", "ArenaBlock", "FileBlock", "FileBlock",
                                          "Streamed", "Streamed"]
        reads = store_requests(client)
        for k in range(6):
            key = block_key(identity, k)
            for rows, named in (([3, -1, 5], "[-1]"), ([50, 2], "[50]"), ([-50, 60, 1, -2], "[-50, -2, 60]")):
                with pytest.raises(ValueError) as info:
                    ask_rows(client, holder, key, rows)
                message = str(info.value)
                assert key in message and named in message and "0..49" in message, (kinds[key], message)
            with pytest.raises(ValueError, match="integer offsets"):
                ask_rows(client, holder, key, [1.5])
        assert store_requests(client) == reads  # not even the streamed blocks were read
        for k in range(6):  # while good offsets still get their rows
            reply = ask_rows(client, holder, block_key(identity, k), [49, 0, 7])
            np.testing.assert_array_equal(reply["x"], zarr_sample(np.array([49, 0, 7]) + 50 * k))
