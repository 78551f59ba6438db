"""dask-jobqueue clusters of dmdask workers: `SLURMCluster`, `PBSCluster` (docs/hpc.md (b)).

Each job runs `dask worker ... --worker-class dmdask.Worker`, its tiers sized from what
the job actually got (`dmdask.worker.sizing`), not from the `memory=` asked for. The
scheduler runs in this process with dmdask's plugin and dashboard page. Every other
keyword goes to dask-jobqueue's own class. Needs `pip install "dmdask[jobqueue]"`.
"""
from __future__ import annotations

from .cluster import ReleasesOnClose, with_dashboard_preload

CLUSTERS = ("PBSCluster", "SLURMCluster")  # made by `__getattr__` on first use, when dask-jobqueue is imported
__all__ = ["dmdask_options"] + list(CLUSTERS)

WORKER_ARGS = ["--worker-class", "dmdask.Worker"]


def dmdask_options(kwargs: dict) -> dict:
    """dask-jobqueue keyword arguments with dmdask's worker class added to the workers'
    arguments and dmdask's dashboard preload to the scheduler's options."""
    options = dict(kwargs)
    extra = list(options.get("worker_extra_args") or [])
    if "--worker-class" in extra:
        raise ValueError("dmdask.jobqueue sets the workers' --worker-class (dmdask.Worker); "
                         "remove it from worker_extra_args")
    options["worker_extra_args"] = extra + WORKER_ARGS
    options["scheduler_options"] = with_dashboard_preload(options.get("scheduler_options"))
    return options


def _cluster_class(name: str):
    try:
        import dask_jobqueue
    except ImportError:
        raise ImportError('dmdask.jobqueue needs dask-jobqueue: pip install "dmdask[jobqueue]" '
                          "(or pip install dask-jobqueue)") from None
    base = getattr(dask_jobqueue, name)

    class Cluster(ReleasesOnClose, base):  # as dmdask.LocalCluster: no "lost" warnings as jobs end
        __doc__ = f"`dask_jobqueue.{name}` whose jobs run dmdask workers sized from their job (dmdask.jobqueue)."

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **dmdask_options(kwargs))

    Cluster.__name__ = Cluster.__qualname__ = name
    Cluster.__module__ = __name__
    return Cluster


def __getattr__(name):
    """The `CLUSTERS`, each made on first use."""
    if name in CLUSTERS:
        cls = _cluster_class(name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
