"""`dmdask.LocalCluster`: Dask's LocalCluster with dmdask workers, for one machine."""
from __future__ import annotations

import distributed

from .worker import Nanny, Worker, capacity


class LocalCluster(distributed.LocalCluster):
    """A `distributed.LocalCluster` whose workers carry dmdask's RAM and SSD tiers.

    ram, ssd: per-worker cache capacities (bytes or strings such as "4 GiB"); ssd=0
    means no SSD tier. ssd_dir: parent folder of the workers' SSD tiers (each worker
    takes its own subfolder, removed when it closes). Other keyword arguments go to
    `distributed.LocalCluster` (n_workers, threads_per_worker, processes, ...).
    """

    def __init__(self, n_workers: int = 2, ram="1 GiB", ssd=0, ssd_dir=None,
                 stream_buffer=None, threads_per_worker: int = 1, processes: bool = True, **kwargs):
        worker_options = {
            "ram": capacity(ram, "ram"),
            "ssd": capacity(ssd, "ssd"),
            "ssd_dir": ssd_dir,
        }
        if stream_buffer is not None:
            worker_options["stream_buffer"] = capacity(stream_buffer, "stream_buffer")
        kwargs.setdefault("dashboard_address", ":0")
        super().__init__(n_workers=n_workers, threads_per_worker=threads_per_worker,
                         processes=processes, worker_class=Nanny if processes else Worker,
                         **worker_options, **kwargs)
