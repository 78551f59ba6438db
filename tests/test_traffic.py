"""Shared-store traffic, counted by the store itself: a real HTTP server that serves the
dataset folder and counts every request and byte (not dmdask's own counters)."""
import os

import distributed
import numpy as np

import dmdask
from dmdask.testing.datasets import folder_sample, write_folder, write_zarr, zarr_sample

from conftest import all_ids, run_epoch

BLOCK = 64
ROW_BYTES = 16 * 4 + 8  # x: 16 float32, label: int64
BLOCK_BYTES = BLOCK * ROW_BYTES


def chunk_traffic(stats, dataset):
    """Requests and bytes the server sent for chunk files (not metadata) of `dataset`."""
    paths = {p: v for p, v in stats["by_path"].items() if p.startswith(dataset + "/") and "/c/" in p}
    return paths, sum(v["bytes"] for v in paths.values())


def chunk_files(root):
    sizes = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if f"{os.sep}c{os.sep}" in path:
                sizes[os.path.relpath(path, os.path.dirname(root))] = os.path.getsize(path)
    return sizes


def write_store(root):  # the `store` fixture's datasets (conftest.py)
    write_zarr(str(root / "train.zarr"), 16 * BLOCK, sample_shape=(16,), chunk=BLOCK, compressed=False)
    write_zarr(str(root / "big.zarr"), 1000, sample_shape=(16,), chunk=BLOCK, compressed=True)
    write_folder(str(root / "files"), classes=2, per_class=30)


def test_cache_holding_the_dataset_reads_every_byte_once(store):
    server, root = store
    files = chunk_files(str(root / "big.zarr"))
    dataset_bytes = sum(files.values())
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        server.reset_stats()
        spec = dmdask.Spec(server.url + "/big.zarr", batch_size=32, seed=1)
        for epoch in range(4):
            ids = all_ids(run_epoch(client, spec, epoch=epoch, world_size=3))
            assert np.array_equal(np.sort(ids), np.arange(1000))
        paths, sent = chunk_traffic(server.stats(), "big.zarr")
        assert sent == dataset_bytes
        assert set(paths) == set(files)
        assert all(v["requests"] == 1 for v in paths.values())  # no block read twice, even in epoch 1
        total = dmdask.stats(client)["total"]
        assert total["shared_store"]["requests"] == len(files) // 2  # one read per block (x and label)
        assert total["ram"]["blocks"] == len(files) // 2
        assert total["ram"]["hits"] == 4 * 1000


def test_half_capacity_meets_the_bound(store):
    server, root = store
    dataset = sum(chunk_files(str(root / "train.zarr")).values())
    assert dataset == 16 * BLOCK_BYTES  # uncompressed: bytes on the store == bytes in the cache
    epochs = 3
    per_worker = 4 * BLOCK_BYTES
    capacity = 2 * per_worker
    assert capacity * 2 == dataset
    with dmdask.LocalCluster(n_workers=2, ram=per_worker, stream_buffer=4 * BLOCK_BYTES) as cluster, \
            distributed.Client(cluster) as client:
        server.reset_stats()
        spec = dmdask.Spec(server.url + "/train.zarr", batch_size=16, seed=2, shuffle_window=2, prefetch=2)
        for epoch in range(epochs):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=2)
            for batches in per_rank:
                for b in batches:
                    np.testing.assert_array_equal(b["x"], zarr_sample(b["index"], (16,)))
            assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(16 * BLOCK))
        _, sent = chunk_traffic(server.stats(), "train.zarr")
        assert sent == epochs * dataset - capacity * (epochs - 1)
        total = dmdask.stats(client)["total"]
        assert total["ram"]["bytes"] == capacity and total["ram"]["blocks"] == 8
        assert total["streamed_blocks"] == 8


def test_folder_over_http_read_once(store):
    server, root = store
    sizes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root / "files") for f in fs)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        server.reset_stats()
        spec = dmdask.Spec(server.url + "/files", batch_size=7, block_size=8)
        listings = []
        for epoch in range(2):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=2)
            listings.append(server.stats()["by_path"].get("files/class-00", {}).get("requests", 0))
            for batches in per_rank:
                for b in batches:
                    assert [d.tobytes() for d in b["data"]] == [folder_sample(int(i)) for i in b["index"]]
            assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(60))
        stats = server.stats()
        sent = sum(v["bytes"] for p, v in stats["by_path"].items() if p.endswith(".bin"))
        assert sent == sizes
        assert listings[0] == listings[1] <= 1, (listings, {p: v for p, v in stats["by_path"].items() if not p.endswith(".bin")})  # the folder is listed once per process, not per epoch


def test_folder_half_capacity_exact_global_shuffle_meets_the_bound(store):
    """One file per sample: samples beyond the cache are read one by one, so even the
    exact global shuffle reads each uncached byte once per epoch and holds nothing."""
    server, root = store
    files = [os.path.join(d, f) for d, _, fs in os.walk(root / "files") for f in fs]
    dataset = sum(os.path.getsize(f) for f in files)
    epochs, block = 3, 6
    with dmdask.LocalCluster(n_workers=2, ram=dataset // 4, stream_buffer=0) as cluster, \
            distributed.Client(cluster) as client:
        server.reset_stats()
        spec = dmdask.Spec(server.url + "/files", batch_size=7, block_size=block, seed=3)
        for epoch in range(epochs):
            per_rank = run_epoch(client, spec, epoch=epoch, world_size=2)
            assert np.array_equal(np.sort(all_ids(per_rank)), np.arange(60))
        total = dmdask.stats(client)["total"]
        # HTTP lists no sizes: each sample is charged when first read, its file's bytes
        # plus 16 (label, object pointer), until the tier is full
        cached_file_bytes = total["ram"]["bytes"] - 16 * total["ram"]["samples"]
        assert 0 < total["ram"]["samples"] < 60 and total["ram"]["bytes"] <= 2 * (dataset // 4)
        sent = sum(v["bytes"] for p, v in server.stats()["by_path"].items() if p.endswith(".bin"))
        assert sent == epochs * dataset - (epochs - 1) * cached_file_bytes
        assert total["stream"]["buffer_bytes"] == 0


def test_folder_first_epoch_streams_samples_into_the_cache(store):
    """One file per sample: the cache fills as ranks ask and, while none of their reads
    waits, by reading ahead; either way every file leaves the store once."""
    server, root = store
    files = [os.path.join(d, f) for d, _, fs in os.walk(root / "files") for f in fs]
    dataset = sum(os.path.getsize(f) for f in files)
    with dmdask.LocalCluster(n_workers=2, ram="16 MiB") as cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(server.url + "/files", batch_size=5, block_size=12, prefetch=2, seed=9)
        dmdask.release(client, spec)
        server.reset_stats()
        for epoch in (0, 1, 2):
            assert np.array_equal(np.sort(all_ids(run_epoch(client, spec, epoch=epoch, world_size=2))), np.arange(60))
        sent = sum(v["bytes"] for p, v in server.stats()["by_path"].items() if p.endswith(".bin"))
        assert sent == dataset
        total = dmdask.stats(client)["total"]
        # each sample read once: for the rank that asked first (a stream hit), or ahead of it
        assert total["stream"]["hits"] + total["shared_store"]["read_ahead"] == 60
        assert total["stream"]["hits"] + total["ram"]["hits"] == 3 * 60
