"""The training process's side: the batch iterator, dataset open/release, the progress bar."""
from .datasets import open_dataset, release
from .iterator import BatchIterator, batches

__all__ = ["BatchIterator", "batches", "open_dataset", "release"]
