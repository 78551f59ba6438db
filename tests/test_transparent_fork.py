"""Transparent mode in the processes a training job makes: forked DataLoader workers
after `dmdask.batches`, one run per job whatever the workers' lifetimes, and reads
that start before any worker joins. Real processes; store requests counted by the
HTTP store itself (benchmarks.store_server)."""
import hashlib
import json
import os
import subprocess
import sys

import pytest

import dmdask
from dmdask.testing.datasets import write_zarr
from benchmarks.store_server import StoreServer

from conftest import wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROCESS_SECONDS = 240  # the most a training process may take


def env(**extra):
    out = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out.update(extra)
    return {k: v for k, v in out.items() if v is not None}


def write_files(folder, n):
    os.makedirs(folder)
    names = []
    for i in range(n):
        name = f"f{i:03d}.bin"
        with open(os.path.join(folder, name), "wb") as f:
            f.write(bytes([i % 251]) * (2000 + 37 * i))
        names.append(name)
    return names


def run_manifest(scheduler, store, names, epochs, batches_first, out, zarr_path="", run=None):
    cmd = [sys.executable, os.path.join(HERE, "transparent_manifest.py"), scheduler, store.url, str(epochs),
           "1" if batches_first else "0", str(out), zarr_path]
    proc = subprocess.run(cmd, input=json.dumps(names), env=env(DMDASK_FS_RUN=run), capture_output=True, text=True,
                          timeout=PROCESS_SECONDS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cluster():
    with dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None) as c:
        yield c


@pytest.mark.slow
def test_forked_loader_workers_after_batches_read_correctly(cluster, tmp_path):
    """The parent iterated `dmdask.batches` (its client, gather pools and threads live)
    and then forks DataLoader workers that read `dmdask::`: every file right, no hang."""
    root = tmp_path / "pfs"
    names = [f"files/{n}" for n in write_files(str(root / "files"), 24)]
    zarr_path = write_zarr(str(tmp_path / "x.zarr"), 256)
    expected = [hashlib.sha1((root / n).read_bytes()).hexdigest() for n in names]
    with StoreServer(str(root)) as store:
        got = run_manifest(cluster.scheduler_address, store, names, 2, True, tmp_path / "out.json", zarr_path)
    assert got["digests"] == [expected, expected]


@pytest.mark.slow
def test_non_persistent_loader_workers_send_no_request_for_cached_files(cluster, tmp_path):
    """A manifest (the main process never reads `dmdask::`), fork workers made anew each
    of 3 epochs, an HTTP store (its listings give no sizes): the store sees one request
    per file over the whole job (its GET; no HEAD, nothing in epochs 2 and 3), and every
    file's bytes once."""
    root = tmp_path / "pfs"
    names = [f"files/{n}" for n in write_files(str(root / "files"), 40)]
    expected = [hashlib.sha1((root / n).read_bytes()).hexdigest() for n in names]
    with StoreServer(str(root)) as store:
        store.reset_stats()
        got = run_manifest(cluster.scheduler_address, store, names, 3, False, tmp_path / "out.json")
        stats = store.stats()
    assert got["digests"] == [expected] * 3
    assert got["listings"][0] == got["listings"][1]  # the parent's HTTP filesystem survived its forks
    files = {p: v for p, v in stats["by_path"].items() if p.endswith(".bin")}
    assert {p: v["bytes"] for p, v in files.items()} == {n: os.path.getsize(root / n) for n in names}
    assert all(v["requests"] == 1 for v in files.values())  # one GET per file over the job
    assert stats["head_requests"] == 0, stats  # size and version came with the GET


READ = ("import hashlib, sys, fsspec\n"
        "import dmdask\n"
        "fs = fsspec.filesystem('dmdask', target_protocol='http', scheduler=sys.argv[1])\n"
        "print(hashlib.sha1(fs.cat_file(sys.argv[2])).hexdigest(), flush=True)\n")


def test_a_read_before_any_worker_joins_waits_for_one(tmp_path):
    """A process reads while the cluster has no workers: it says so once and waits; a
    worker joins once it said so, and the read returns the file's bytes."""
    root = tmp_path / "pfs"
    names = write_files(str(root / "files"), 1)
    said = tmp_path / "reader.err"
    with StoreServer(str(root)) as store, \
            dmdask.LocalCluster(n_workers=0, ram="64 MiB", dashboard_address=None) as empty, open(said, "w") as log:
        reader = subprocess.Popen([sys.executable, "-c", READ, empty.scheduler_address,
                                   f"{store.url}/files/{names[0]}"], env=env(), stdout=subprocess.PIPE,
                                  stderr=log, text=True)
        wait_until(lambda: "has no workers: waiting up to" in said.read_text() or reader.poll() is not None,
                   PROCESS_SECONDS, "the reader saying it waits for a worker")
        assert reader.poll() is None, said.read_text()  # waiting, not failed
        empty.scale(1)
        out, _ = reader.communicate(timeout=PROCESS_SECONDS)
    err = said.read_text()
    assert reader.returncode == 0, err
    assert out.strip() == hashlib.sha1((root / "files" / names[0]).read_bytes()).hexdigest()
    assert err.count("has no workers: waiting up to") == 1, err


def test_waits_are_bounded_with_errors_that_say_what_is_missing(tmp_path):
    """No worker within dmdask.client.recovery-seconds: NoWorkersError; no scheduler at
    the address: SchedulerLostError naming it."""
    root = tmp_path / "pfs"
    names = write_files(str(root / "files"), 1)
    quick = env(DASK_DMDASK__CLIENT__RECOVERY_SECONDS="2", DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="2s")
    with StoreServer(str(root)) as store, \
            dmdask.LocalCluster(n_workers=0, ram="64 MiB", dashboard_address=None) as empty:
        url = f"{store.url}/files/{names[0]}"
        done = subprocess.run([sys.executable, "-c", READ, empty.scheduler_address, url], env=quick,
                              capture_output=True, text=True, timeout=PROCESS_SECONDS)
        assert done.returncode != 0 and "NoWorkersError" in done.stderr and "recovery-seconds" in done.stderr
        done = subprocess.run([sys.executable, "-c", READ, "tcp://127.0.0.1:9", url], env=quick,
                              capture_output=True, text=True, timeout=PROCESS_SECONDS)
    assert done.returncode != 0 and "SchedulerLostError" in done.stderr and "tcp://127.0.0.1:9" in done.stderr


READ_TWO = ("import hashlib, os, sys, time, fsspec\n"
            "import dmdask\n"
            "fs = fsspec.filesystem('dmdask', target_protocol='http', scheduler=sys.argv[1])\n"
            "print(hashlib.sha1(fs.cat_file(sys.argv[2])).hexdigest(), flush=True)\n"
            "while not os.path.exists(sys.argv[4]):\n"
            "    time.sleep(0.05)\n"
            "fs.cat_file(sys.argv[3])\n")


@pytest.mark.slow
def test_a_scheduler_lost_during_a_run_is_a_scheduler_lost_error(tmp_path):
    """A reader has read one file; the scheduler is SIGKILLed; its next read (a file new to
    it, so it must ask the scheduler) raises SchedulerLostError naming what to do, within
    the configured time, not a raw CommClosedError and not a wait without end."""
    from framework_cases import free_port
    from test_failures import _start_cluster, _stop

    root = tmp_path / "pfs"
    names = write_files(str(root / "files"), 2)
    port = free_port()
    procs = _start_cluster(port, tmp_path, "fs")
    marker = tmp_path / "scheduler-killed"
    try:
        with StoreServer(str(root)) as store:
            reader = subprocess.Popen(
                [sys.executable, "-c", READ_TWO, f"tcp://127.0.0.1:{port}", f"{store.url}/files/{names[0]}",
                 f"{store.url}/files/{names[1]}", str(marker)],
                env=env(DASK_DMDASK__CLIENT__RECOVERY_SECONDS="3", DASK_DMDASK__CLIENT__SCHEDULER_SECONDS="3"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            first = reader.stdout.readline().strip()  # the scheduler and its workers start meanwhile
            assert first == hashlib.sha1((root / "files" / names[0]).read_bytes()).hexdigest(), reader.stderr.read()
            procs[0].kill()
            procs[0].wait(30)
            marker.touch()
            _, err = reader.communicate(timeout=PROCESS_SECONDS)
    finally:
        if reader.poll() is None:
            reader.kill()
        _stop(procs)
    assert reader.returncode != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("dmdask.errors.SchedulerLostError"), err[-3000:]
