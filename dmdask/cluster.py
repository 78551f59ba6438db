"""`dmdask.LocalCluster`: Dask's LocalCluster with dmdask workers, for one machine."""
from __future__ import annotations

import dask
import distributed

from .worker import Nanny, Worker, capacity

DASHBOARD_PRELOAD = "dmdask.dashboard"


class LocalCluster(distributed.LocalCluster):
    """A `distributed.LocalCluster` whose workers carry dmdask's RAM and SSD tiers.

    ram, ssd, ssd_dir, shm_dir, stream_buffer: per-worker cache capacities (bytes or
    strings such as "4 GiB"; ssd=0 means no SSD tier) and the parent folders of the
    workers' SSD and shared-memory RAM tiers (each worker takes its own subfolder,
    removed when it closes); unset ones come from
    the `dmdask.worker` config namespace (`DASK_DMDASK__WORKER__RAM=...`). The scheduler
    runs the `dmdask.dashboard` preload: dmdask's scheduler plugin, the `/dmdask`
    dashboard page, `/dmdask/tiers.json` and the `dmdask_*` Prometheus metrics. Other keyword arguments go to
    `distributed.LocalCluster` (n_workers, processes, dashboard_address, scheduler_kwargs, ...).
    """

    def __init__(self, n_workers: int = 2, ram=None, ssd=None, ssd_dir=None, shm_dir=None,
                 stream_buffer=None, threads_per_worker: int = 1, processes: bool = True, **kwargs):
        given = {"ram": ram, "ssd": ssd, "stream_buffer": stream_buffer}
        worker_options = {name: capacity(value, name) for name, value in given.items() if value is not None}
        for name, value in (("ssd_dir", ssd_dir), ("shm_dir", shm_dir)):
            if value is not None:
                worker_options[name] = value
        kwargs.setdefault("dashboard_address", ":0")
        kwargs["scheduler_kwargs"] = with_dashboard_preload(kwargs.get("scheduler_kwargs"))
        super().__init__(n_workers=n_workers, threads_per_worker=threads_per_worker,
                         processes=processes, worker_class=Nanny if processes else Worker,
                         **worker_options, **kwargs)

    async def _close(self):
        """Release dmdask's datasets, then close as Dask does. The cache goes with the
        cluster anyway; released first, its blocks are no longer results the scheduler
        would warn it "lost" (and plan to recompute) as each worker leaves."""
        release_datasets(self.scheduler)
        await super()._close()


def release_datasets(scheduler) -> int:
    """Release every dataset of the dmdask plugin of an in-process scheduler (none when
    the scheduler is elsewhere or has no plugin); returns how many."""
    from .scheduler import DatasetsPlugin

    plugin = getattr(scheduler, "extensions", {}).get("dmdask")
    if not isinstance(plugin, DatasetsPlugin):
        return 0
    return sum(bool(plugin.release(name)) for name in list(plugin.datasets))


def with_dashboard_preload(scheduler_kwargs) -> dict:
    """`scheduler_kwargs` with `dmdask.dashboard` added to the scheduler's preloads.

    The scheduler reads `distributed.scheduler.preload` from config only when given no
    preload, so configured preloads are carried over; `preload_argv` given per preload
    gets an empty entry for ours.
    """
    options = dict(scheduler_kwargs or {})
    preload = options.get("preload") or dask.config.get("distributed.scheduler.preload") or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    if DASHBOARD_PRELOAD in preload:
        return options
    argv = options.get("preload_argv") or dask.config.get("distributed.scheduler.preload-argv") or []
    argv = list(argv)
    if argv and not isinstance(argv[0], str):  # one list of arguments per preload
        argv.append([])
        options["preload_argv"] = argv
    elif argv:
        options["preload_argv"] = argv
    options["preload"] = preload + [DASHBOARD_PRELOAD]
    return options
