"""`dmdask.LocalCluster`: Dask's LocalCluster with dmdask workers, for one machine."""
from __future__ import annotations

import dask
import distributed

from .worker import Nanny, Worker, capacity

DASHBOARD_PRELOAD = "dmdask.dashboard"


class ReleasesOnClose:
    """A cluster whose closing (`close()`, also at the end of `with` and at exit; `async
    with`) releases dmdask's datasets first: released, its blocks are no results the
    scheduler warns it "lost" (and plans to recompute) as each worker leaves."""

    def close(self, timeout=None):
        if self.status == distributed.Status.running:  # on the loop, queued before Dask's close (FIFO)
            self.loop.add_callback(self.release_datasets)
        return super().close(timeout)

    async def __aexit__(self, *exc_info):
        self.release_datasets()
        await super().__aexit__(*exc_info)

    def release_datasets(self) -> int:
        """Release every dataset of the dmdask plugin of the in-process scheduler (none when
        the scheduler is elsewhere or has no plugin); on the cluster's loop. Returns how many."""
        from .scheduler import DatasetsPlugin

        plugin = getattr(self.scheduler, "extensions", {}).get("dmdask")
        if not isinstance(plugin, DatasetsPlugin):
            return 0
        return sum(bool(plugin.release(name)) for name in list(plugin.datasets))


class LocalCluster(ReleasesOnClose, distributed.LocalCluster):
    """A `distributed.LocalCluster` whose workers carry dmdask's RAM and SSD tiers and whose
    scheduler runs the `dmdask.dashboard` preload (dmdask's plugin, page and Prometheus metrics).

    ram, ssd, ssd_dir, shm_dir, stream_buffer: those of each `dmdask.Worker` (bytes or
    "4 GiB"; ssd=0: no SSD tier); unset, from the `dmdask.worker` config. Other keyword
    arguments go to `distributed.LocalCluster`.
    """

    def __init__(self, n_workers: int = 2, ram=None, ssd=None, ssd_dir=None, shm_dir=None,
                 stream_buffer=None, threads_per_worker: int = 1, processes: bool = True, **kwargs):
        given = {"ram": ram, "ssd": ssd, "stream_buffer": stream_buffer}
        worker_options = {name: capacity(value, name) for name, value in given.items() if value is not None}
        worker_options.update({n: v for n, v in (("ssd_dir", ssd_dir), ("shm_dir", shm_dir)) if v is not None})
        kwargs.setdefault("dashboard_address", ":0")
        kwargs["scheduler_kwargs"] = with_dashboard_preload(kwargs.get("scheduler_kwargs"))
        super().__init__(n_workers=n_workers, threads_per_worker=threads_per_worker,
                         processes=processes, worker_class=Nanny if processes else Worker,
                         **worker_options, **kwargs)


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
    argv = list(options.get("preload_argv") or dask.config.get("distributed.scheduler.preload-argv") or [])
    if argv and not isinstance(argv[0], str):  # one list of arguments per preload
        argv.append([])
    if argv:
        options["preload_argv"] = argv
    options["preload"] = preload + [DASHBOARD_PRELOAD]
    return options
