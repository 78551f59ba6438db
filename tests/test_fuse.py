"""`dmdask mount`: POSIX readers (plain `open()`) read a store folder through the
cluster's cache. Bytes are counted by the HTTP store itself."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import dmdask
from dmdask.testing.datasets import write_folder
from dmdask.testing.mount import unmount
from benchmarks.store_server import StoreServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOUNT_SECONDS = 60  # the most the mount may take to appear
READ_SECONDS = 240  # the most a reader process may take
SIZES = {"min_size": 1000, "max_size": 150_000}

# Each reader walks the mount in sorted order, `epochs` times, and checks every file.
READER = """
import os, sys
from dmdask.testing.datasets import folder_sample
mnt, epochs = sys.argv[1], int(sys.argv[2])
for epoch in range(epochs):
    seen = 0
    for folder, dirs, files in sorted(os.walk(mnt)):
        for name in sorted(files):
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            assert data == folder_sample(int(name[2:10]), min_size=%(min_size)d, max_size=%(max_size)d), name
            seen += 1
    print(seen, flush=True)
""" % SIZES


def fuse_missing():
    """Why FUSE cannot be used here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "this machine has no /dev/fuse (FUSE is not available in this container)"
    if not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "no fusermount3 or fusermount on PATH (apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy or libfuse missing (pip install mfusepy; apt-get install fuse3): {exc}"
    return None


def env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


@contextlib.contextmanager
def mounted(url: str, mountpoint, scheduler: str):
    """`dmdask mount URL MOUNTPOINT` in its own process, once the mount is there; unmounted after."""
    mount = subprocess.Popen([sys.executable, "-m", "dmdask.cli", "mount", url, str(mountpoint),
                              "--scheduler", scheduler], env=env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + MOUNT_SECONDS
        while not os.path.ismount(mountpoint):
            assert mount.poll() is None, f"dmdask mount exited: {mount.stderr.read()}"
            assert time.monotonic() < deadline, "the mount did not appear"
            time.sleep(0.2)
        yield mount
    finally:
        unmount(mount, str(mountpoint))


def file_sizes(folder, root) -> dict:
    """{path relative to root: size} of every file under `folder`."""
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
            for d, _, names in os.walk(folder) for f in names}


@pytest.mark.slow
@pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))
def test_a_mount_read_by_two_processes_over_two_epochs_reads_the_store_once(tmp_path):
    root = tmp_path / "pfs"
    write_folder(str(root / "images"), classes=3, per_class=15, **SIZES)
    sizes = file_sizes(root / "images", root)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with StoreServer(str(root)) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None) as cluster:
        with mounted(f"{store.url}/images", mountpoint, cluster.scheduler_address):
            readers = [subprocess.Popen([sys.executable, "-c", READER, str(mountpoint), "2"], env=env(),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
            for reader in readers:
                out, err = reader.communicate(timeout=READ_SECONDS)
                assert reader.returncode == 0, err
                assert out.split() == ["45", "45"]  # every file, each epoch
        by_path = store.stats()["by_path"]
    assert {p: by_path[p]["bytes"] for p in sizes} == sizes  # 2 processes x 2 epochs, each byte once
    assert all(by_path[p]["requests"] == 1 for p in sizes)
    assert store.stats()["head_requests"] == 0  # sizes came with the first blocks' GETs


# Reads the files named on stdin, one thread each, and prints how many it read.
THREADS = """
import concurrent.futures, sys
def read(path):
    with open(path, "rb") as f:
        return len(f.read())
paths = sys.stdin.read().split()
with concurrent.futures.ThreadPoolExecutor(len(paths)) as pool:
    print(sum(1 for n in pool.map(read, paths) if n > 0), flush=True)
"""


def max_in_flight(timeline):
    """The most GETs in flight at once, from their (start, end) times."""
    events = sorted([(start, 1) for start, _ in timeline] + [(end, -1) for _, end in timeline])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.mark.slow
@pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))
def test_the_mount_serves_concurrent_readers_concurrently(tmp_path):
    """8 threads open and read 8 new files of the mount at once, over a store that takes
    0.3 s a request: the store sees their GETs in flight together (the mount serves
    several FUSE requests at a time), one GET per file and no HEAD. The files are in 8
    folders: the kernel sends lookups of names in one folder one at a time (see
    dmdask.fs.mount), and a new file's first GET is made at its lookup."""
    root = tmp_path / "pfs"
    write_folder(str(root / "images"), classes=8, per_class=1, **SIZES)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with StoreServer(str(root), latency=0.3) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None) as cluster:
        with mounted(f"{store.url}/images", mountpoint, cluster.scheduler_address):
            paths = [os.path.join(d, f) for d, _, names in os.walk(mountpoint) for f in names]
            assert len(paths) == 8
            store.reset_stats()
            store.record_timeline()
            reader = subprocess.run([sys.executable, "-c", THREADS], input="\n".join(paths), env=env(),
                                    capture_output=True, text=True, timeout=READ_SECONDS)
            assert reader.returncode == 0, reader.stderr
            assert reader.stdout.split() == ["8"]
        stats, timeline = store.stats(), store.timeline()
    assert stats["requests"] == 8 and stats["head_requests"] == 0, stats
    assert max_in_flight(timeline) >= 2, timeline


@pytest.mark.slow
@pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))
def test_a_lookup_reads_the_next_files_of_its_folder_ahead(tmp_path):
    """One reader opens the 10 new files of one folder one after the other, over a store that
    takes 0.3 s a request: the lookup of the first also reads the first blocks of the others
    (the kernel sends lookups in one folder one at a time), so the store sees GETs in flight
    together; still one GET per file (and the folder's listing), no HEAD, each byte once,
    every file's right bytes."""
    root = tmp_path / "pfs"
    write_folder(str(root / "images"), classes=1, per_class=10, **SIZES)
    sizes = file_sizes(root / "images", root)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with StoreServer(str(root), latency=0.3) as store, \
            dmdask.LocalCluster(n_workers=2, ram="64 MiB", dashboard_address=None) as cluster:
        with mounted(f"{store.url}/images", mountpoint, cluster.scheduler_address):
            assert os.listdir(mountpoint) == ["class-00"]
            store.reset_stats()
            store.record_timeline()
            reader = subprocess.run([sys.executable, "-c", READER, str(mountpoint), "1"], env=env(),
                                    capture_output=True, text=True, timeout=READ_SECONDS)
            assert reader.returncode == 0, reader.stderr
            assert reader.stdout.split() == ["10"]
        stats, timeline = store.stats(), store.timeline()
    assert {p: stats["by_path"][p]["bytes"] for p in sizes} == sizes
    assert all(stats["by_path"][p]["requests"] == 1 for p in sizes) and stats["head_requests"] == 0, stats
    assert max_in_flight(timeline) >= 2, timeline


@pytest.mark.slow
@pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_unmounts_and_exits_0(tmp_path, stop):
    """The documented ways to stop a mount end it cleanly: unmounted, exit status 0, nothing
    on stderr (libfuse's own handling exited 1 with `dmdask mount: 8`)."""
    root = tmp_path / "pfs"
    write_folder(str(root / "images"), classes=2, per_class=2, **SIZES)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with StoreServer(str(root)) as store, \
            dmdask.LocalCluster(n_workers=1, ram="64 MiB", dashboard_address=None) as cluster:
        with mounted(f"{store.url}/images", mountpoint, cluster.scheduler_address) as mount:
            assert sorted(os.listdir(mountpoint)) == ["class-00", "class-01"]
            mount.send_signal(stop)
            _, err = mount.communicate(timeout=60)
            assert mount.returncode == 0, err
            assert "dmdask mount" not in err, err
            assert not os.path.ismount(mountpoint)


@pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))
def test_a_source_that_does_not_exist_is_refused_naming_it(tmp_path):
    """Nothing is mounted for a folder the store does not have: exit status 1 and an error
    naming the URL (it mounted an empty folder)."""
    root = tmp_path / "pfs"
    write_folder(str(root / "images"), classes=2, per_class=2, **SIZES)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    with StoreServer(str(root)) as store, \
            dmdask.LocalCluster(n_workers=1, ram="64 MiB", dashboard_address=None) as cluster:
        for url in (f"{store.url}/imagez", str(tmp_path / "nowhere")):
            mount = subprocess.Popen([sys.executable, "-m", "dmdask.cli", "mount", url, str(mountpoint),
                                      "--scheduler", cluster.scheduler_address], env=env(),
                                     stderr=subprocess.PIPE, text=True)
            try:
                _, err = mount.communicate(timeout=MOUNT_SECONDS)
            finally:
                unmount(mount, str(mountpoint))
            assert mount.returncode == 1, err
            assert err.strip().splitlines()[-1] == f"dmdask mount: {url} does not exist: nothing to mount (give a " \
                "folder of the store, e.g. https://host/train or s3://bucket/train)", err
            assert not os.listdir(mountpoint)
