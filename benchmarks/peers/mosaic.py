"""Peer: Mosaic's StreamingDataset over MDS shards on the S3 server, a local cache per node."""
from __future__ import annotations

import os

import numpy as np

from .dataset import sample_id
from .s3 import BUCKET

NAME, LABEL, FORMAT, STORE = "mosaic", "Mosaic StreamingDataset", "mds", "s3"
CAN = {"exactly_once": "yes, but pads ranks to equal sample counts by repeating samples",
       "cache": "whole shards on the node's disk (local), evicted past cache_limit",
       "shared_cache": "no: a cache per node (ranks of a node share it)"}


def _import_streaming():
    """`import streaming`. Its package imports torchvision for its vision datasets alone; PyPI's
    torchvision is built for CUDA torch and cannot load beside the CPU build, so when it
    fails a stub with the two names those modules take stands in (nothing here uses them)."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - RuntimeError: operator torchvision::nms does not exist
        import importlib.machinery
        import sys
        import types

        names = ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional")
        stub = {name: types.ModuleType(name) for name in names}
        for name, module in stub.items():
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        stub["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})
        stub["torchvision.datasets"].CIFAR10 = type("CIFAR10", (), {})
        stub["torchvision.transforms.functional"].to_tensor = None
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules.update(stub)
    import streaming

    return streaming


def available():
    try:
        _import_streaming()
    except ImportError as exc:
        return f"mosaicml-streaming is not importable: {exc} (make bench-peers installs it)"
    return None


def settings(cfg: dict) -> str:
    return ("`StreamingDataset(remote='s3://…/mds', local=<node disk>, shuffle=True, shuffle_algo='py1e', "
            f"shuffle_seed=0, num_canonical_nodes=<nodes>, batch_size={cfg['batch']}, cache_limit=<node cache>)`; "
            f"`DataLoader(batch_size={cfg['batch']}, num_workers={cfg['loader_workers']})`; WORLD_SIZE, RANK, "
            "LOCAL_WORLD_SIZE, LOCAL_RANK set as torchrun does")


def collate(items):
    return [item["data"] for item in items]


def batch_ids(batch) -> np.ndarray:
    return np.array([sample_id(d) for d in batch], dtype=np.int64)


class Loader:
    def __init__(self, ctx: dict):
        import torch.utils.data

        self.dataset = _import_streaming().StreamingDataset(
            remote=f"s3://{BUCKET}/mds", local=os.path.join(ctx["node_dir"], "mosaic"), shuffle=True,
            shuffle_algo="py1e", shuffle_seed=ctx["seed"], num_canonical_nodes=ctx["nodes"],
            batch_size=ctx["batch"], cache_limit=max(ctx["node_cache_bytes"], ctx["min_cache_bytes"]))
        self.loader = torch.utils.data.DataLoader(self.dataset, batch_size=ctx["batch"],
                                                  num_workers=ctx["loader_workers"], collate_fn=collate)

    def epoch(self, epoch: int):
        return self.loader  # the dataset counts its epochs itself

    ids = staticmethod(batch_ids)

    def close(self):
        pass
