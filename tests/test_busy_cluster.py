"""A busy cluster is not a failing one: a batch whose blocks are still loading (or queued)
waits for them past `dmdask.client.recovery-seconds` (which bounds faults: lost workers,
moved blocks), up to `dmdask.client.load-seconds`, and then fails saying so. Real worker
processes and a real HTTP store that holds the reads of one block until the test lets go."""
import re
import threading

import dask
import distributed
import numpy as np
import pytest

import dmdask
from benchmarks.store_server import StoreServer
from dmdask.testing.datasets import write_zarr, zarr_sample

BLOCK_0 = re.compile(r"/c/0(/|$)")  # the chunks of block 0 (samples 0..49) of every field


@pytest.fixture(scope="module")
def cluster_and_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("pfs")
    for name in ("waits", "fails"):
        write_zarr(str(root / f"{name}.zarr"), 200, chunk=50)
    # a held read is not given up and retried
    with dask.config.set({"dmdask.store.read-seconds": 300}), StoreServer(str(root)) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as client:
        yield client, store


def _chunk_requests(store, name: str) -> dict:
    return {p: v["requests"] for p, v in store.stats()["by_path"].items() if p.startswith(f"{name}.zarr/") and "/c/" in p}


def test_a_batch_waits_past_recovery_seconds_for_a_block_still_loading(cluster_and_store):
    """Block 0's reads are held 15 s, 2.5 times the ranks' recovery time (6 s: a holder's
    reply may take 3 s, more than the 2 s it waits for a load): its load is running on its
    worker all that time. The first batch waits for it (before: `RuntimeError ... still
    failing after 6 s ... is the cluster losing workers?`), comes after the release with
    exactly its samples, and the epoch is every sample once, each chunk read from the store
    once."""
    client, store = cluster_and_store
    store.hold(lambda path: path.startswith("waits.zarr/") and BLOCK_0.search(path))
    released = threading.Event()

    def release():
        released.set()
        store.release()

    timer = threading.Timer(15, release)
    timer.start()
    try:
        with dask.config.set({"dmdask.client.recovery-seconds": 6}):
            it = dmdask.batches(client, dmdask.Spec(store.url + "/waits.zarr", batch_size=50, shuffle=False),
                                progress=False)
            first = next(it)
            came_after_release = released.is_set()
            rest = list(it)
    finally:
        timer.cancel()
        store.release()
    assert came_after_release, "the first batch came while block 0's reads were held"
    np.testing.assert_array_equal(first["index"], np.arange(50))
    np.testing.assert_array_equal(first["x"], zarr_sample(np.arange(50)))
    ids = np.concatenate([first["index"]] + [b["index"] for b in rest])
    assert sorted(ids.tolist()) == list(range(200))
    assert set(_chunk_requests(store, "waits").values()) == {1}, _chunk_requests(store, "waits")


def test_a_batch_whose_block_loads_past_load_seconds_fails_saying_the_cluster_is_busy(cluster_and_store):
    """Block 0's reads held until the test ends: past `dmdask.client.load-seconds` (8 s) the
    batch fails naming what it waited for (its blocks still loading on their worker) and the
    setting to raise, not a lost worker."""
    client, store = cluster_and_store
    store.hold(lambda path: path.startswith("fails.zarr/") and BLOCK_0.search(path))
    try:
        with dask.config.set({"dmdask.client.recovery-seconds": 6, "dmdask.client.load-seconds": 8}):
            it = dmdask.batches(client, dmdask.Spec(store.url + "/fails.zarr", batch_size=200, shuffle=False),
                                progress=False)
            with pytest.raises(RuntimeError) as raised:
                next(it)
            it.close()
    finally:
        store.release()
    said = str(raised.value)
    # block 0, and block 2 queued behind it on the same one-thread worker (while it runs)
    assert re.search(r"batches 0\.\.0 of rank 0: ([12]) of its 4 blocks still not loaded after 8 s \(\1 loading or "
                     r"queued on their workers, 0 waited for on the scheduler", said), said
    assert "raise dmdask.client.load-seconds" in said and "is the cluster losing workers?" not in said, said
