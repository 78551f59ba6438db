"""A store that fails part of the requests, on real worker processes and a real HTTP store:
folder epochs retry only the files that failed (with backoff) and so make progress; a
dataset whose opening gets a 503 is opened again; a file whose body does not have the
size its listing said is never cached or delivered."""
import os

import dask
import distributed
import numpy as np
import pytest

import dmdask
from benchmarks.store_server import StoreServer
from dmdask.testing.datasets import folder_sample, write_folder

FILES = 256


def _epoch(client, spec):
    got = list(dmdask.batches(client, spec))
    return np.concatenate([b["index"] for b in got]), [bytes(d) for b in got for d in b["data"]]


def _file_bytes(ids, **sizes):
    return [folder_sample(int(i), **sizes) for i in ids]


def test_a_store_that_throttles_a_share_of_requests_fails_no_folder_epoch(tmp_path):
    """Every 10th GET of a sample file answers 503 (a block of 64 files always had a failure
    among them: retrying every file of the block never succeeded) and the first GETs of the
    folder's listings too: the epoch delivers every sample once, with the store's bytes,
    for few more GETs than files."""
    write_folder(str(tmp_path / "images"), classes=4, per_class=FILES // 4)
    with StoreServer(str(tmp_path)) as store:
        with dask.config.set({"dmdask.store.retry-seconds": 10}):
            cluster = dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None)
        with cluster, distributed.Client(cluster) as client:
            store.fail_first(1, "images/class-0[0-9]")  # the class folders' listings, read as it is opened
            store.fail_every(10, "*.bin")
            ids, data = _epoch(client, dmdask.Spec(store.url + "/images", batch_size=64, block_size=64, seed=3))
            assert sorted(ids.tolist()) == list(range(FILES))
            assert data == _file_bytes(ids)
            assert store.stats()["failed"] >= 4 + FILES // 10
            file_gets = _gets(store, ".bin")
            assert FILES < file_gets < 2 * FILES, file_gets  # each file read once, the failed ones again


def _gets(store, suffix):
    by_path = store.stats()["by_path"]
    return sum(v["requests"] for p, v in by_path.items() if p.endswith(suffix))


def test_a_file_whose_body_is_not_its_listed_size_is_never_delivered(tmp_path):
    """A file cut after its folder was listed (its body then shorter than the listing said,
    with a Content-Length that agrees): no worker caches or delivers it; the read names
    the file and both sizes once the retries are spent."""
    root = write_folder(str(tmp_path / "images"), classes=1, per_class=8, min_size=1000)
    with dask.config.set({"dmdask.store.retry-seconds": 1}):
        cluster = dmdask.LocalCluster(n_workers=1, ram="0 B", ssd="0 B", dashboard_address=None)
    with cluster, distributed.Client(cluster) as client:
        spec = dmdask.Spec(root, batch_size=8, block_size=8)  # nothing cached: every epoch reads the store
        ids, data = _epoch(client, spec)
        assert data == _file_bytes(ids, min_size=1000)
        cut = os.path.join(root, "class-00", "s-00000005.bin")
        whole = open(cut, "rb").read()
        with open(cut, "wb") as f:
            f.write(whole[:len(whole) // 2])
        with pytest.raises(dmdask.BlockReadError, match=rf"s-00000005.bin: read {len(whole) // 2} bytes, listed as "
                                                        rf"{len(whole)}"):
            _epoch(client, spec)


def test_a_store_whose_requests_sometimes_hang_fails_no_zarr_epoch(tmp_path):
    """Every 3rd chunk GET hangs (60 s): a read that receives nothing for
    `dmdask.store.read-seconds` is given up and retried, so the epoch delivers every sample
    once with the store's values, inside the ranks' recovery time (aiohttp's 300 s was the
    only deadline: the rank failed at its recovery time, 'still failing after 60 s')."""
    from dmdask.testing.datasets import write_zarr, zarr_sample

    write_zarr(str(tmp_path / "d.zarr"), 400, chunk=50)
    with StoreServer(str(tmp_path)) as store:
        with dask.config.set({"dmdask.store.read-seconds": 1}):
            cluster = dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None)
        with cluster, distributed.Client(cluster) as client, \
                dask.config.set({"dmdask.client.recovery-seconds": 20, "dmdask.store.read-seconds": 1}):
            store.hang_every(3, "d.zarr/*/c/*", seconds=60)
            got = list(dmdask.batches(client, dmdask.Spec(store.url + "/d.zarr", batch_size=50)))
            ids = np.concatenate([b["index"] for b in got])
            assert sorted(ids.tolist()) == list(range(400))
            np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), zarr_sample(ids))
            assert store.stats()["hung"] >= 4
            store.hang_every(0)
