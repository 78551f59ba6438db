"""`load_block`, the Dask task a client submits once per block, and `load_group`, the one it
submits once per load group of a large dataset (`dmdask.plan.groups`), which a dmdask
worker runs (here, so that `dmdask.client` submits them without importing `dmdask.worker`)."""
from __future__ import annotations

import distributed
from distributed.protocol.pickle import dumps, loads

from .errors import plain_worker
from .source.urls import check_source


def load_block(reader):
    """Dask task: the value of a block's key on the worker that runs it (its `BlockCache`,
    which the worker plugin installs).
    `SourceNotAllowedError` for a source outside `dmdask.worker.allowed-sources`."""
    return _cache_for([reader]).load(reader)


def _cache_for(readers: list):
    """This worker's `BlockCache`, once every source the readers read is allowed
    (`SourceNotAllowedError` otherwise); an error naming a worker without dmdask's plugin."""
    for reader in readers:
        for url in reader.sources():
            check_source(url)
    worker = distributed.get_worker()
    cache = worker.extensions.get("dmdask")
    if cache is None:
        raise plain_worker(worker.address)
    return cache


class GroupReaders:
    """The argument of `load_group`: the readers of a load group's blocks and the group's key.
    The readers travel as one pickled payload, unpickled only where `readers` is read (the
    worker): the scheduler, which unpickles every task's arguments, holds one bytes object
    per group instead of ~7 objects per block (fewer objects for its garbage collector)."""

    def __init__(self, key: str, readers: list):
        self.key, self._readers, self._payload = key, list(readers), None

    @property
    def readers(self) -> list:
        if self._readers is None:
            self._readers = loads(self._payload)
        return self._readers

    def __getstate__(self) -> dict:
        return {"key": self.key, "payload": self._payload if self._readers is None else dumps(self._readers)}

    def __setstate__(self, state: dict) -> None:
        self.key, self._payload, self._readers = state["key"], state["payload"], None


def load_group(group: GroupReaders):
    """Dask task: each block of the group loaded as `load_block` loads it and kept under its
    own block key on this worker; the group's value names them (released with it).
    `SourceNotAllowedError` for a source outside `dmdask.worker.allowed-sources`."""
    return _cache_for(group.readers).load_group(group.readers)
