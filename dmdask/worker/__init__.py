"""The dmdask worker: Dask's worker with tiered block storage and dmdask's handlers.

Start it with `dask worker SCHEDULER --worker-class dmdask.Worker`; capacities come
from the `dmdask.worker` config namespace (or keyword arguments).
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import dask
import distributed
from dask.utils import parse_bytes

from ..errors import NotADmdaskWorker, SpecError
from ..source.urls import check_source
from .cache import BlockCache
from .modes import group_id
from .tiers import TieredStore

DEFAULT_SHM = "/dev/shm"
logger = logging.getLogger("distributed.worker")  # the one line of tiers among the worker's own start lines


def capacity(value, name: str) -> int:
    """Bytes from an int or a string such as "4 GiB"; a clear error otherwise."""
    try:
        result = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        result = -1
    if result < 0:
        raise SpecError(name, 'a size in bytes or a string such as "4 GiB"', value)
    return result


def load_block(reader):
    """Dask task: the value of a block's key on the worker that runs it.
    `SourceNotAllowedError` for a source outside `dmdask.worker.allowed-sources`."""
    check_source(reader.url)
    worker = distributed.get_worker()
    cache: Optional[BlockCache] = getattr(worker, "dmdask", None)
    if cache is None:
        raise NotADmdaskWorker(
            f"worker {worker.address} has no dmdask tiers; start workers with "
            "`dask worker ADDR --worker-class dmdask.Worker` or use dmdask.LocalCluster"
        )
    return cache.load(reader)


class Worker(distributed.Worker):
    """A Dask worker whose storage holds dmdask blocks in a RAM and an SSD tier.

    ram, ssd: per-worker capacities (bytes or "4 GiB"); ssd=0 disables the SSD tier.
    ssd_dir: folder of the SSD tier (default: the worker's local directory). One that
    cannot be used does not stop the worker: see `TieredStore.open_ssd`.
    shm_dir: shared-memory folder of the RAM tier (default /dev/shm; "" keeps RAM blocks
    in the worker's own memory, readable only through it).
    stream_buffer: bytes for blocks beyond the cache while ranks take their rows.
    group: a group (name or id) that may read the tiers' files too (default none: only
    the worker's user; `dmdask.worker.modes`).
    Unset values come from the `dmdask.worker` dask config namespace.
    """

    def __init__(self, *args, ram=None, ssd=None, ssd_dir=None, shm_dir=None, stream_buffer=None,
                 group=None, **kwargs):
        def config(name, value):
            return value if value is not None else dask.config.get(f"dmdask.worker.{name}")

        store = TieredStore(
            ram=capacity(config("ram", ram), "ram"),
            ssd=capacity(config("ssd", ssd), "ssd"),
            ssd_dir=config("ssd-dir", ssd_dir),
            shm_dir=_shm_folder(config("shm-dir", shm_dir)),
            gid=group_id(config("group", group)),
        )
        kwargs["data"] = store
        super().__init__(*args, **kwargs)
        store.default_ssd_root(self.local_directory)
        store.remove_stale()  # what crashed workers of this node left behind
        store.open_ssd()  # an unusable ssd_dir: a warning and stats()["ssd"]["error"], not a crash
        store.check_shared_memory()  # a RAM tier larger than /dev/shm: a warning and stats()["ram"]["warning"]
        buffer = capacity(config("stream-buffer", stream_buffer), "stream_buffer")
        self.dmdask = BlockCache(self, store, buffer, read_threads=int(dask.config.get("dmdask.worker.read-threads")),
                                 transform_threads=int(dask.config.get("dmdask.worker.transform-threads")))

    async def start_unsafe(self):
        await super().start_unsafe()
        logger.info("dmdask tiers: %s", self.dmdask.store.describe())
        return self

    async def close(self, *args, **kwargs):
        try:
            return await super().close(*args, **kwargs)
        finally:
            self.dmdask.close()
            self.dmdask.store.close()


def _shm_folder(value):
    """The shared-memory root: the default /dev/shm only where the system has one."""
    if value == DEFAULT_SHM and not os.path.isdir(value):
        return None
    return value or None


class Nanny(distributed.Nanny):
    """A Dask nanny that starts a dmdask `Worker` (keyword arguments pass through)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("worker_class", Worker)
        super().__init__(*args, **kwargs)


__all__ = ["BlockCache", "Nanny", "TieredStore", "Worker", "capacity", "load_block"]
