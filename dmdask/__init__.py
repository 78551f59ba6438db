"""dmdask: a shared, tiered block cache on Dask distributed that feeds training loops
(docs/quickstart.md). `dmdask::` URLs read files through the cluster's cache (docs/transparent.md).
`dask scheduler --preload dmdask` installs the scheduler plugin; without the preload the
first `dmdask.batches` call registers it.
"""
from .config import register as _register_config
from .client import BatchIterator, batches, release
from .cluster import LocalCluster
from .errors import (BlockReadError, DatasetHeldError, DmdaskError, HandlerArgumentError, NoWorkersError,
                     NotADmdaskWorker, SchedulerLostError, SourceError, SourceNotAllowedError, SourceNotFoundError,
                     SpecError, TransformError, WorkerKilledError)
from .spec import Mix, Spec, Tokens, TransformContext, Window, per_sample, transform_context
from .ranks import Rank, rank_from_environment
from .stats import stats
from .worker import Worker
from .fs.register import register as _register_fs

_register_config()  # the `dmdask` namespace of dask config
_register_fs()  # `dmdask::` URLs for fsspec (and webdataset)

__version__ = "0.1.0"

__all__ = [
    "BatchIterator", "BlockReadError", "DatasetHeldError", "DmdaskError", "HandlerArgumentError", "LocalCluster",
    "Mix", "NoWorkersError", "NotADmdaskWorker", "Rank", "SchedulerLostError", "SourceError",
    "SourceNotAllowedError", "SourceNotFoundError", "Spec", "SpecError", "Tokens", "TransformContext",
    "TransformError", "Window", "Worker", "WorkerKilledError", "batches", "per_sample", "rank_from_environment", "release", "stats",
    "transform_context",
]


def dask_setup(scheduler) -> None:
    """Preload entry point (`dask scheduler --preload dmdask`): install the scheduler plugin."""
    from .scheduler import install

    install(scheduler)
