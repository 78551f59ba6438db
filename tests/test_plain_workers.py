"""A cluster of plain Dask workers (started without `--worker-class dmdask.Worker`): every
dmdask request that reaches one raises `NotADmdaskWorker` naming the worker and the fix,
for `dmdask.batches` at any dataset size and for `dmdask::` reads."""
import os
import subprocess
import sys

import distributed
import fsspec
import numpy as np
import pytest

import dmdask
import dmdask.fs
from dmdask.testing.datasets import write_zarr
from benchmarks.store_server import StoreServer

from conftest import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = "--worker-class dmdask.Worker"


@pytest.fixture(scope="module")
def plain():
    """(cluster, client): two plain Dask worker processes, no dmdask tiers."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        yield cluster, client
        dmdask.fs.close()


def names_a_worker_and_the_fix(exc, cluster) -> bool:
    message = str(exc)
    workers = cluster.scheduler_info["workers"]
    return FIX in message and "has no dmdask tiers" in message and any(w in message for w in workers)


def plus_one(batch):
    return {"x": batch["x"] + 1, "index": batch["index"]}


@pytest.mark.parametrize("n, chunk, transform", [(40, 64, None), (6000, 100, None), (60_000, 1000, None),
                                                 (6000, 100, plus_one)])
def test_batches_name_the_plain_worker_and_the_fix(plain, tmp_path, n, chunk, transform):
    cluster, client = plain
    path = write_zarr(str(tmp_path / "d.zarr"), n=n, chunk=chunk)
    spec = dmdask.Spec(path, batch_size=32, transform=transform)
    with pytest.raises(dmdask.NotADmdaskWorker) as raised:
        list(dmdask.batches(client, spec))
    assert names_a_worker_and_the_fix(raised.value, cluster), raised.value


def test_dmdask_reads_name_the_plain_worker_and_the_fix(plain, tmp_path):
    """The first read of a file returns its bytes (read from the store by this process);
    handing them to a worker reaches a plain one, and from then every read raises, here and
    in another process (whose blocks' loads failed on the plain workers)."""
    cluster, client = plain
    (tmp_path / "files").mkdir()
    blobs = {f"f{i}.bin": np.random.default_rng(i).bytes(50_000) for i in range(3)}
    for name, blob in blobs.items():
        (tmp_path / "files" / name).write_bytes(blob)
    with StoreServer(str(tmp_path)) as server:
        url = f"{server.url}/files"
        assert fsspec.open(f"dmdask::{url}/f0.bin").open().read() == blobs["f0.bin"]

        def refused():
            try:
                fsspec.open(f"dmdask::{url}/f1.bin").open().read()
            except dmdask.NotADmdaskWorker as exc:
                return exc
            return None
        exc = wait_until(refused, 30, "a dmdask:: read raising NotADmdaskWorker")
        assert names_a_worker_and_the_fix(exc, cluster), exc
        code = ("import sys, fsspec\nimport dmdask\n"
                "try:\n    fsspec.open('dmdask::' + sys.argv[2], scheduler=sys.argv[1]).open().read()\n"
                "except dmdask.NotADmdaskWorker as exc:\n    print('refused:', exc)\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-c", code, cluster.scheduler_address, f"{url}/f0.bin"], env=env,
                             capture_output=True, text=True, timeout=240)
        assert out.stdout.startswith("refused:") and FIX in out.stdout, (out.stdout, out.stderr[-2000:])
