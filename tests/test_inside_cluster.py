"""`dmdask::` reads that run as tasks on the dmdask cluster's own workers (xarray with dask
chunks, dask.dataframe): each worker reads through its own scheduler connection and cache,
with the direct read's results and each byte from the store once; a task that waits for a
block whose load is queued on its own (one-thread) worker does not wait on itself."""
import os

import dask
import distributed
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dmdask
import dmdask.fs
from benchmarks.store_server import StoreServer

PASSES = 3


def write_store(root):
    import xarray
    rng = np.random.default_rng(1)
    weather = xarray.Dataset(
        {"t2m": (("time", "lat", "lon"), rng.normal(size=(48, 30, 20)).astype("f4")),
         "wind": (("time", "lat", "lon"), rng.normal(size=(48, 30, 20)).astype("f4"))},
        coords={"time": np.arange(48), "lat": np.arange(30.0), "lon": np.arange(20.0)})
    weather.chunk({"time": 8}).to_zarr(str(root / "weather.zarr"), mode="w")
    (root / "pq").mkdir()
    for i in range(3):
        ids = np.arange(i * 3000, (i + 1) * 3000)
        pq.write_table(pa.table({"id": ids, "v": rng.normal(size=3000)}), str(root / "pq" / f"p{i}.parquet"),
                       row_group_size=1000)
    return weather


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("pfs")
    weather = write_store(root)
    with StoreServer(str(root)) as server:
        yield server, root, weather


@pytest.fixture(scope="module")
def client():
    """The user's client to a dmdask cluster of two one-thread workers (no
    `dmdask.fs.scheduler` set: the workers find the cluster themselves)."""
    with dmdask.LocalCluster(n_workers=2, threads_per_worker=1, ram="64 MiB", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as c:
        yield c
        dmdask.fs.close()


def sent(server, folder) -> int:
    """Bytes the store sent for the files under `folder` since its counts were reset."""
    return sum(v["bytes"] for p, v in server.stats()["by_path"].items() if p.startswith(folder + "/"))


def direct_bytes(server, folder, read) -> int:
    """The bytes under `folder` one pass of `read()` (the pipeline over the store's own
    HTTP URLs, on the cluster) takes from the store: the dataset as the reader reads it."""
    server.reset_stats()
    read()
    size = sent(server, folder)
    server.reset_stats()
    return size


def test_xarray_open_zarr_with_dask_chunks_on_the_cluster(store, client):
    import xarray
    server, root, weather = store
    direct = xarray.open_zarr(str(root / "weather.zarr"))  # the same pipeline over the files themselves
    want_means, want_slice = direct.mean("time").compute(), direct.isel(time=slice(5, 20)).compute()
    xarray.testing.assert_equal(want_slice, weather.isel(time=slice(5, 20)))
    size = direct_bytes(server, "weather.zarr", lambda: xarray.testing.assert_identical(
        xarray.open_zarr(f"{server.url}/weather.zarr").mean("time").compute(), want_means))
    for _ in range(PASSES):
        opened = xarray.open_zarr(f"dmdask::{server.url}/weather.zarr")  # dask chunks: its default
        assert opened.t2m.chunks == direct.t2m.chunks
        xarray.testing.assert_identical(opened.mean("time").compute(), want_means)  # tasks on the dmdask workers
        xarray.testing.assert_identical(opened.isel(time=slice(5, 20)).compute(), want_slice)
    assert 0.99 * size <= sent(server, "weather.zarr") <= 1.02 * size


def test_dask_dataframe_read_parquet_on_the_cluster(store, client):
    import dask.dataframe as dd
    server, root, _ = store
    want = pa.concat_tables(pq.read_table(str(root / "pq" / f"p{i}.parquet")) for i in range(3)).to_pandas()
    want = want.sort_values("id").reset_index(drop=True)
    size = sum(os.path.getsize(root / "pq" / f"p{i}.parquet") for i in range(3))  # each file a block: read whole
    server.reset_stats()
    for _ in range(PASSES):
        frame = dd.read_parquet(f"dmdask://{server.url}/pq/*.parquet", split_row_groups=True)
        assert frame.npartitions == 9  # row groups: tasks that share files, and their blocks
        got = frame.compute().sort_values("id").reset_index(drop=True)
        assert got.equals(want)
    assert 0.99 * size <= sent(server, "pq") <= 1.02 * size


def _read_in_a_task(url: str, seconds: float) -> bytes:
    import fsspec
    with dask.config.set({"dmdask.client.recovery-seconds": seconds}):
        return fsspec.open(url).open().read()


def test_a_task_waiting_for_a_load_queued_on_its_own_worker_gets_its_bytes(store, client, tmp_path):
    """This process reads a new file first (it claims the block and hands it to its
    planned worker later); a task on each one-thread worker reads the same file meanwhile
    and waits for that load, which is queued behind it on the planned worker: the task
    leaves the worker's thread pool while it waits, so the load runs and both tasks get
    the file's bytes (before, the wait ran out after dmdask.client.recovery-seconds)."""
    import fsspec
    server, root, _ = store
    blob = np.random.default_rng(9).bytes(300_000)
    (root / "shared.bin").write_bytes(blob)
    url = f"dmdask::{server.url}/shared.bin"
    server.reset_stats()
    workers = sorted(client.scheduler_info()["workers"])
    assert fsspec.open(url).open().read() == blob  # claimed here, handed over in the background
    futures = [client.submit(_read_in_a_task, url, 20, workers=[w], pure=False) for w in workers]
    assert client.gather(futures) == [blob, blob]
    assert server.stats()["by_path"]["shared.bin"]["bytes"] == len(blob)  # read from the store once
