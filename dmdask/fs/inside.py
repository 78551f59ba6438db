"""Transparent-mode reads from inside the cluster: a `dmdask::` read that runs in a Dask
worker's process (a task of xarray, dask.array, dask.dataframe) goes through that worker's
own scheduler connection, and a task's thread that waits for blocks leaves the worker's
thread pool meanwhile, so the loads it waits for can run on that same worker.
"""
from __future__ import annotations

import contextlib
import weakref

import distributed
from distributed.core import Status

_worker: weakref.ref | None = None  # the Dask worker this process runs, once its dmdask plugin is set up


@contextlib.contextmanager
def out_of_the_pool():
    """While a Dask task's thread waits for blocks (a read in a task of xarray or
    dask.dataframe): the thread leaves its worker's thread pool (`distributed.worker_client`
    secedes it), so the loads it waits for can run on that worker too, and rejoins after.
    On any other thread nothing."""
    try:
        distributed.get_worker()
    except ValueError:
        yield
        return
    with distributed.worker_client():
        yield


def serve_worker(worker) -> None:
    """Called by the worker plugin: reads in this process (tasks of xarray, dask.dataframe,
    ...) go through `worker`'s own scheduler connection (its client), not a new one."""
    global _worker
    _worker = weakref.ref(worker)


def serving():
    """The running worker of this process, or None."""
    worker = _worker() if _worker is not None else None
    return worker if worker is not None and worker.status == Status.running else None
