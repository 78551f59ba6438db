"""What the scenarios share: datasets on a counting store, clusters, ranks, timers."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Callable, Dict, List

import distributed
import numpy as np

import dmdask
from .store_server import StoreServer


def machine() -> dict:
    """The machine the figures come from."""
    import psutil

    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform(),
            "dmdask": dmdask.__version__, "dask": distributed.__version__,
            "processor": platform.processor() or platform.machine(),
            "load_1min": round(os.getloadavg()[0], 2)}  # at the run's start: above ~0.5 the figures are loaded


@contextlib.contextmanager
def workdir(prefix: str):
    path = tempfile.mkdtemp(prefix=f"dmdask-bench-{prefix}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_files(root: str, n: int, sample_bytes: int, classes: int = 10, seed: int = 0) -> List[str]:
    """ImageNet-style folder: `classes` subfolders, n files of `sample_bytes` bytes each.

    File i (in dmdask's sorted order) starts with its id, so readers can be checked."""
    rng = np.random.default_rng(seed)
    per_class = -(-n // classes)
    paths = []
    for i in range(n):
        c = i // per_class
        folder = os.path.join(root, f"class-{c:03d}")
        if i % per_class == 0:
            os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"s-{i:08d}.bin")
        head = i.to_bytes(8, "little")
        with open(path, "wb") as f:
            f.write(head + rng.integers(0, 256, sample_bytes - 8, dtype=np.uint8).tobytes())
        paths.append(path)
    return paths


def dataset_bytes(paths: List[str]) -> int:
    return sum(os.path.getsize(p) for p in paths)


def served_bytes(store: StoreServer, suffix: str = ".bin") -> Dict[str, int]:
    """What the store sent for sample files (not listings or metadata), by its own count."""
    by_path = store.stats()["by_path"]
    chosen = [v for p, v in by_path.items() if p.endswith(suffix) or "/c/" in p]
    return {"bytes": sum(v["bytes"] for v in chosen), "requests": sum(v["requests"] for v in chosen)}


def run_ranks(world: int, fn: Callable[[int], object]) -> list:
    """fn(rank) for every rank at once, one thread each (ranks progress together)."""
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(fn, range(world)))


def dmdask_cluster(n_workers: int, ram, ssd=0, stream_buffer=None, **kwargs):
    return dmdask.LocalCluster(n_workers=n_workers, ram=ram, ssd=ssd, stream_buffer=stream_buffer,
                               dashboard_address=None, **kwargs)


def peak_rss_mib() -> float:
    """This process's own peak resident memory (`VmHWM`), in MiB. Not `ru_maxrss`: a
    spawned process inherits its parent's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class Stopwatch:
    """Wall time of a block, and the part of it spent waiting for data."""

    def __init__(self):
        self.total = 0.0
        self.waiting = 0.0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def wait(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.waiting += time.perf_counter() - started


def stop_processes(procs) -> None:
    """Terminate `subprocess.Popen`s, last started first; kill any still running after 30 s."""
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def scheduler_address(scheduler_file: str, seconds: float = 60.0) -> str:
    """The address a `dask scheduler --scheduler-file` writes, once it is there whole;
    `TimeoutError` naming the file after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(scheduler_file) as f:
                return json.load(f)["address"]
        except (FileNotFoundError, ValueError, KeyError):  # not yet written, or half written
            time.sleep(0.1)
    raise TimeoutError(f"no scheduler address in {scheduler_file} after {seconds:g} s: did the scheduler start?")


def ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else float("nan")
