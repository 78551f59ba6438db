"""The dmdask worker (`dask worker SCHEDULER --worker-class dmdask.Worker`): Dask's worker
with tiered block storage (`TieredStore`); its handlers come with the worker plugin the
scheduler plugin installs (`dmdask.worker.plugin`)."""
from __future__ import annotations

import atexit
import logging
import os
import sys

import dask
import distributed
from dask.utils import parse_bytes

from ..errors import SpecError
from ..shm.modes import group_id
from ..tasks import load_block
from . import sizing
from .cache import NO_COUNTS, BlockCache
from .plugin import WorkerPlugin
from .tiers import TieredStore

DEFAULT_SHM = "/dev/shm"
_starting = False  # a Worker was made in this process (else: a `dask worker` CLI process, or none)
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


class Worker(distributed.Worker):
    """A Dask worker whose storage holds dmdask blocks in a RAM and an SSD tier.

    Each keyword (ram, ssd, ssd_dir, shm_dir, stream_buffer, group) overrides the
    `dmdask.worker` config key of that name (`dmdask.yaml` says what each means); unset
    ram and ssd are sized from the job (`dmdask.worker.sizing`). An unusable ssd_dir
    does not stop the worker.
    """

    def __init__(self, *args, ram=None, ssd=None, ssd_dir=None, shm_dir=None, stream_buffer=None,
                 group=None, **kwargs):
        global _starting
        _starting = True

        def config(name, value):
            return value if value is not None else dask.config.get(f"dmdask.worker.{name}")

        shm = _shm_folder(config("shm-dir", shm_dir))
        ram_size = _sized_ram(config("ram", ram), shm)
        ssd_setting = config("ssd", ssd)
        ssd_root, ssd_dir_source = sizing.ssd_folder(os.environ, config("ssd-dir", ssd_dir))
        store = TieredStore(ram_size.bytes, capacity(ssd_setting, "ssd") if ssd_setting is not None else 0,
                            ssd_dir=ssd_root, shm_dir=shm, gid=group_id(config("group", group)))
        store.set_capacity("ram", ram_size.bytes, ram_size.source)
        kwargs["data"] = store
        super().__init__(*args, **kwargs)
        store.default_ssd_root(self.local_directory)
        if ssd_setting is None:
            ssd_size = sizing.ssd_size(os.environ, store.root("ssd"),
                                       float(dask.config.get("dmdask.worker.job.ssd-share")))
        else:
            ssd_size = sizing.explicit(store.ssd.capacity, "ssd")
        store.set_capacity("ssd", ssd_size.bytes, f"{ssd_size.source}; folder: {ssd_dir_source}")
        store.remove_stale()
        store.open_ssd()
        store.check_shared_memory()
        self.stream_buffer = capacity(config("stream-buffer", stream_buffer), "stream_buffer")
        # the tiers until the worker plugin's cache adds its counts: the scheduler reads a
        # joining worker's room from this metric (`dmdask.scheduler.placement.win_back`)
        self.metrics["dmdask"] = lambda worker: {**store.stats(), **NO_COUNTS}

    async def start_unsafe(self):
        await super().start_unsafe()
        logger.info("dmdask tiers: %s", self.data.describe())
        return self

    async def close(self, *args, **kwargs):
        try:
            return await super().close(*args, **kwargs)
        finally:
            self.data.close()


def _sized_ram(setting, shm_dir) -> sizing.Sized:
    if setting is not None:
        return sizing.explicit(capacity(setting, "ram"), "ram")
    return sizing.ram_size(os.environ, shm_dir,
                           headroom=capacity(dask.config.get("dmdask.worker.job.headroom"), "job.headroom"),
                           share=float(dask.config.get("dmdask.worker.job.ram-share")))


def _shm_folder(value):
    """The shared-memory root: the default /dev/shm only where the system has one."""
    if value == DEFAULT_SHM and not os.path.isdir(value):
        return None
    return value or None


SETTINGS = (("ram", "ram"), ("ssd", "ssd"), ("stream_buffer", "stream-buffer"))  # (SpecError field, config key)


def settings_error() -> tuple | None:
    """(config key, `SpecError`) of the first `dmdask.worker` capacity in the dask config that
    a `Worker` would refuse; None if every one is usable or unset."""
    for name, key in SETTINGS:
        value = dask.config.get(f"dmdask.worker.{key}", None)
        if value is not None:
            try:
                capacity(value, name)
            except SpecError as exc:
                return key, exc
    return None


@atexit.register
def _bad_setting_said_last() -> None:
    """A process that starts workers (`dask worker`, whose nanny reports a worker that failed
    to start under a traceback of its own, or one that made a `Worker`) ending on an
    unhandled error with a `dmdask.worker` setting a worker refuses: the setting and its fix
    are the last line it prints."""
    if getattr(sys, "last_value", None) is None or not (_starting or "distributed.cli.dask_worker" in sys.modules):
        return  # ended well, or not a process that starts workers
    found = settings_error()
    if found is not None:
        key, error = found
        print(f"dmdask worker: not started: {error} (dask config dmdask.worker.{key}, environment variable "
              f"DASK_DMDASK__WORKER__{key.upper().replace('-', '_')})", file=sys.stderr, flush=True)


class Nanny(distributed.Nanny):
    """A Dask nanny that starts a dmdask `Worker` (keyword arguments pass through)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("worker_class", Worker)
        super().__init__(*args, **kwargs)


__all__ = ["BlockCache", "Nanny", "TieredStore", "Worker", "WorkerPlugin", "capacity", "load_block"]
