import concurrent.futures
import time
import warnings

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.testing.datasets import write_zarr


def run_epoch(client, spec, epoch=0, world_size=None, concurrent_ranks=True):
    """All ranks' batches of one epoch, each rank iterating in its own thread."""
    world = world_size or spec.world_size
    specs = [spec.replace(rank=r, world_size=world) for r in range(world)]

    def one(s):
        return list(dmdask.batches(client, s, epoch=epoch))

    if not concurrent_ranks:
        return [one(s) for s in specs]
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, specs))


def wait_until(condition, seconds: float, what: str, pause: float = 0.05):
    """Poll `condition()` until it returns something true, and return that; after
    `seconds` without, fail naming `what` was awaited."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(pause)
    return value


def all_ids(per_rank):
    return np.concatenate([b["index"] for batches in per_rank for b in batches])


@pytest.fixture(scope="module")
def client():
    """A real cluster: two dmdask worker processes on this machine."""
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB") as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.fixture(autouse=True)
def _quiet_zarr():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata")
        yield


@pytest.fixture(scope="module")
def zarr_path(request, tmp_path_factory):
    """A Zarr group of `dmdask.testing.datasets.write_zarr` (each value tells its sample),
    shaped by the module's `ZARR` (write_zarr's arguments, e.g. dict(n=1003, chunk=64))."""
    return write_zarr(str(tmp_path_factory.mktemp("shared") / "d.zarr"), **request.module.ZARR)


@pytest.fixture(scope="module")
def store(request, tmp_path_factory):
    """(server, root): a folder that the module's `write_store(root)` fills, served over
    HTTP by a `benchmarks.store_server.StoreServer` (a stand-in shared store)."""
    root = tmp_path_factory.mktemp("pfs")
    request.module.write_store(root)
    # imported here: workers import test modules for their transforms, and so this one
    from benchmarks.store_server import StoreServer

    with StoreServer(str(root)) as server:
        yield server, root


@pytest.fixture
def fail_reads(store):
    """For `dmdask.testing.sources.SourceTests`: the module's store (a `StoreServer`, root) answers
    `status` to the first n GETs of each of its files, until the test ends."""
    server = store[0]
    yield lambda n, status: server.fail_first(n, "*", status)
    server.fail_first(0)
