"""Peer: LitData's StreamingDataset over optimized chunks on the S3 server, a cache per node."""
from __future__ import annotations

import os
import time

import numpy as np

from .dataset import sample_id
from .s3 import BUCKET

NAME, LABEL, FORMAT, STORE = "litdata", "LitData StreamingDataset", "litdata", "s3"
CAN = {"exactly_once": "drops the tail so ranks get equal counts (drop_last=True, its default when distributed)",
       "cache": "chunks on the node's disk (cache_dir), deleted past max_cache_size",
       "shared_cache": "no: a cache per node"}


def available():
    try:
        import litdata  # noqa: F401
    except ImportError as exc:
        return f"litdata is not importable: {exc} (make bench-peers installs it)"
    return None


def settings(cfg: dict) -> str:
    return ("`StreamingDataset(input_dir='s3://…/litdata', cache_dir=<node disk>, shuffle=True, seed=0, "
            "max_cache_size=<node cache>, storage_options={'endpoint_url': …})`; "
            f"`StreamingDataLoader(batch_size={cfg['batch']}, num_workers={cfg['loader_workers']})`; "
            "torch.distributed initialised, NNODES set; `allow_http` added to its obstore client options, which "
            "refuse the local http:// endpoint otherwise (a real S3 is https); built once more when it finds no "
            "index.json (the ranks of a node race on it in their shared cache_dir)")


def collate(items):
    return [bytes(item["data"]) for item in items]  # a memoryview cannot leave the worker process


def batch_ids(batch) -> np.ndarray:
    return np.array([sample_id(d) for d in batch], dtype=np.int64)


class Loader:
    def __init__(self, ctx: dict):
        import litdata.streaming.downloader as downloader
        from litdata import StreamingDataLoader, StreamingDataset

        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # see settings(): the endpoint is http://

        cache = os.path.join(ctx["node_dir"], "litdata")
        os.makedirs(cache, exist_ok=True)
        options = dict(input_dir=f"s3://{BUCKET}/litdata", cache_dir=cache, shuffle=True, seed=ctx["seed"],
                       max_cache_size=max(ctx["node_cache_bytes"], ctx["min_cache_bytes"]),
                       storage_options={"endpoint_url": ctx["s3_url"]})
        try:
            self.dataset = StreamingDataset(**options)
        except ValueError:  # the ranks of a node race on index.json in their shared cache_dir: once more
            time.sleep(1)
            self.dataset = StreamingDataset(**options)
        self.loader = StreamingDataLoader(self.dataset, batch_size=ctx["batch"],
                                          num_workers=ctx["loader_workers"], collate_fn=collate)

    def epoch(self, epoch: int):
        return self.loader  # StreamingDataLoader counts its epochs itself

    ids = staticmethod(batch_ids)

    def close(self):
        pass
