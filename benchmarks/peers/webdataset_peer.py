"""Peer: WebDataset over tar shards on the HTTP store, each node caching whole shards on its disk."""
from __future__ import annotations

import os

import numpy as np

from .dataset import sample_id

NAME, LABEL, FORMAT, STORE = "webdataset", "WebDataset", "tar", "http"
CAN = {"exactly_once": "shards split over ranks and workers (split_by_node, split_by_worker): each sample once, "
                       "but ranks get unequal counts unless shards divide evenly; the shard shuffle comes after the "
                       "split (webdataset 1.0), so a rank gets the same shards every epoch and never another "
                       "rank's samples",
       "cache": "whole shards on the node's disk (cache_dir), LRU past cache_size by a cleanup that runs every "
                "30 s (so runs this short keep every shard they read)",
       "shared_cache": "no: a cache per node"}


def available():
    try:
        import webdataset  # noqa: F401
    except ImportError as exc:
        return f"webdataset is not importable: {exc}"
    return None


def settings(cfg: dict) -> str:
    return ("`WebDataset(urls, resampled=False, shardshuffle=len(urls), seed=epoch, nodesplitter=split_by_node, "
            "workersplitter=split_by_worker, cache_dir=<node disk>, cache_size=<node cache>)`"
            f"`.shuffle(1000).to_tuple('bin', 'cls').batched({cfg['batch']}, partial=True)`; "
            f"`WebLoader(batch_size=None, num_workers={cfg['loader_workers']})`, one per epoch")


def batch_ids(batch) -> np.ndarray:
    return np.array([sample_id(d) for d in batch[0]], dtype=np.int64)


class Loader:
    def __init__(self, ctx: dict):
        self.ctx = ctx
        self.cache_dir = os.path.join(ctx["node_dir"], "webdataset")
        os.makedirs(self.cache_dir, exist_ok=True)

    def epoch(self, epoch: int):
        import webdataset as wds

        c = self.ctx
        ds = (wds.WebDataset(c["tar_urls"], resampled=False, shardshuffle=len(c["tar_urls"]), seed=c["seed"] + epoch,
                             nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
                             cache_dir=self.cache_dir, cache_size=c["node_cache_bytes"], empty_check=False)
              .shuffle(1000).to_tuple("bin", "cls").batched(c["batch"], partial=True))
        return wds.WebLoader(ds, batch_size=None, num_workers=c["loader_workers"])

    ids = staticmethod(batch_ids)

    def close(self):
        pass
