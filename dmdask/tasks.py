"""`load_block`, the Dask task a client submits once per block and a dmdask worker runs (here,
so that `dmdask.client` submits it without importing `dmdask.worker`)."""
from __future__ import annotations

import distributed

from .errors import plain_worker
from .source.urls import check_source


def load_block(reader):
    """Dask task: the value of a block's key on the worker that runs it (its `BlockCache`,
    which the worker plugin installs).
    `SourceNotAllowedError` for a source outside `dmdask.worker.allowed-sources`."""
    for url in reader.sources():
        check_source(url)
    worker = distributed.get_worker()
    cache = worker.extensions.get("dmdask")
    if cache is None:
        raise plain_worker(worker.address)
    return cache.load(reader)
