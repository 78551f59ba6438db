"""Peer: PyTorch DataLoader + DistributedSampler reading each sample's file from the HTTP store."""
from __future__ import annotations

import numpy as np

from ..baselines import ProcessLocalFiles, collate
from .dataset import sample_id

NAME, LABEL, FORMAT, STORE = "dataloader", "DataLoader + DistributedSampler", "files", "http"
CAN = {"exactly_once": "pads the last round with repeated samples so ranks get equal shares (drop_last=False)",
       "cache": "none: every epoch reads the store", "shared_cache": "no cache"}


def available():
    import fsspec.implementations.http  # noqa: F401 - what the dataset reads with
    import torch.utils.data  # noqa: F401
    return None


def settings(cfg: dict) -> str:
    return (f"`DistributedSampler(shuffle=True, seed=0)`, `set_epoch(e)`; `DataLoader(batch_size={cfg['batch']}, "
            f"num_workers={cfg['loader_workers']}, persistent_workers=True, prefetch_factor=2)`; a map-style "
            "dataset whose `__getitems__` GETs a batch's files concurrently (fsspec HTTP)")


def batch_ids(batch) -> np.ndarray:
    return np.array([sample_id(d) for d in batch["data"]], dtype=np.int64)


class Loader:
    DATASET = ProcessLocalFiles  # a batch's files in one `fs.cat`

    def __init__(self, ctx: dict):
        import torch.utils.data

        labels = [0] * len(ctx["file_urls"])
        self.dataset = self.DATASET(ctx["file_urls"], labels)
        self.sampler = torch.utils.data.distributed.DistributedSampler(
            self.dataset, num_replicas=ctx["world"], rank=ctx["rank"], shuffle=True, seed=ctx["seed"])
        workers = ctx["loader_workers"]
        extra = {"persistent_workers": True, "prefetch_factor": 2} if workers else {}
        self.loader = torch.utils.data.DataLoader(self.dataset, batch_size=ctx["batch"], sampler=self.sampler,
                                                  num_workers=workers, collate_fn=collate, **extra)

    def epoch(self, epoch: int):
        self.sampler.set_epoch(epoch)
        return self.loader

    ids = staticmethod(batch_ids)

    def close(self):
        pass
