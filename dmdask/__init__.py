"""dmdask: a shared, tiered block cache on Dask distributed that feeds training loops.

    import dmdask
    cluster = dmdask.LocalCluster(n_workers=2, ram="2 GiB")
    client = distributed.Client(cluster)
    spec = dmdask.Spec(source="data/train.zarr", batch_size=256)
    for batch in dmdask.batches(client, spec, epoch=0):
        ...
"""
from . import config as _config  # noqa: F401  (registers the dmdask config namespace)
from .cluster import LocalCluster
from .errors import (BlockReadError, DmdaskError, NotADmdaskWorker, SourceError,
                     SourceNotFoundError, SpecError, TransformError)
from .loader import BatchIterator, batches, release
from .spec import Spec, per_sample
from .stats import stats
from .worker import Worker

__version__ = "0.1.0"

__all__ = [
    "BatchIterator", "BlockReadError", "DmdaskError", "LocalCluster", "NotADmdaskWorker",
    "SourceError", "SourceNotFoundError", "Spec", "SpecError", "TransformError", "Worker", "batches",
    "per_sample", "release", "stats",
]
