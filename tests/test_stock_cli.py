"""A cluster started with the stock CLI and nothing else: `dask scheduler` without dmdask's
preload (documented as supported), `dask worker --worker-class dmdask.Worker`, and
`dmdask status`, each in a process of its own; what each prints is read from its output."""
import contextlib
import os
import subprocess
import sys

import distributed
import numpy as np
import pytest

import dmdask
from dmdask.testing.datasets import write_zarr

from conftest import wait_until

BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env(**extra):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                DASK_DMDASK__PROGRESS="false", **extra)


@pytest.fixture
def scheduler(tmp_path):
    """(address, path of its log) of a `dask scheduler` without any preload."""
    scheduler_file, log = tmp_path / "scheduler.json", tmp_path / "scheduler.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([os.path.join(BIN, "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                 "--dashboard-address", ":0", "--scheduler-file", str(scheduler_file)],
                                stdout=out, stderr=subprocess.STDOUT, env=env())
    try:
        wait_until(lambda: scheduler_file.exists() and scheduler_file.stat().st_size, 60, "the scheduler's file")
        with distributed.Client(scheduler_file=str(scheduler_file), timeout=30) as client:
            address = client.scheduler.address
        yield address, log
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def dmdask_worker(address, tmp_path):
    proc = subprocess.Popen([os.path.join(BIN, "dask"), "worker", address, "--worker-class", "dmdask.Worker",
                             "--nthreads", "1", "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env(DASK_DMDASK__WORKER__RAM="16 MiB"), cwd=tmp_path)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def test_first_contact_with_a_scheduler_without_the_preload_logs_no_error(scheduler, tmp_path):
    """The first rank registers the plugin before its first request: the scheduler logged
    `KeyError: 'dmdask_get_or_claim'` (no handler) under a traceback before."""
    address, log = scheduler
    path = write_zarr(str(tmp_path / "d.zarr"), 300, chunk=32)
    with dmdask_worker(address, tmp_path), distributed.Client(address, timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        ids = np.concatenate([b["index"] for b in dmdask.batches(client, dmdask.Spec(path, batch_size=64))])
        assert np.array_equal(np.sort(ids), np.arange(300))
    text = log.read_text()
    assert "Traceback" not in text and "KeyError" not in text and "No handler" not in text, text


def test_status_of_a_cluster_without_workers_says_so(scheduler):
    """`dmdask status` with no worker ended in `KeyError: 'ram'`."""
    address, _ = scheduler
    done = subprocess.run([sys.executable, "-m", "dmdask.cli", "status", address], env=env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (f"workers: none (the scheduler at {address} has no workers; start them "
                                           f"with `dask worker {address} --worker-class dmdask.Worker`)")
    assert "datasets: none yet" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("nanny", [True, False], ids=["nanny", "no-nanny"])
def test_a_worker_with_a_bad_ram_setting_says_so_last_and_exits_non_zero(scheduler, tmp_path, nanny):
    """`DASK_DMDASK__WORKER__RAM=lots`: the worker does not start, and the last line it prints
    names the setting, the value and what is expected (the SpecError was 50 lines above
    the end, under the nanny's traceback)."""
    address, _ = scheduler
    done = subprocess.run([os.path.join(BIN, "dask"), "worker", address, "--worker-class", "dmdask.Worker",
                           "--host", "127.0.0.1"] + ([] if nanny else ["--no-nanny"]),
                          env=env(DASK_DMDASK__WORKER__RAM="lots"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "dmdask worker: not started: ram='lots' is invalid: expected a size in bytes or a string such as "
        '"4 GiB" (dask config dmdask.worker.ram, environment variable DASK_DMDASK__WORKER__RAM)'), done.stderr
