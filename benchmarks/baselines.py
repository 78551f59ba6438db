"""The loaders users would pick, reading the same store: PyTorch's DataLoader with a
DistributedSampler, and the same with a per-node cache and no sharing (Monarch)."""
from __future__ import annotations

import os
import threading
from typing import List, Optional

import fsspec
import numpy as np


class StoreFiles:
    """A map-style dataset of files on the store: item i is file i's bytes and label.

    `__getitems__` lets the DataLoader fetch a whole batch in one concurrent call."""

    def __init__(self, urls: List[str], labels: Optional[List[int]] = None):
        self.urls = list(urls)
        self.labels = labels if labels is not None else [0] * len(urls)
        self.fs, path = fsspec.core.url_to_fs(urls[0])
        chain = urls[0][: len(urls[0]) - len(path)] if urls[0].endswith(path) else ""  # "dmdask::", or ""
        self.paths = [u[len(chain):] for u in self.urls]

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices):
        paths = [self.paths[i] for i in indices]
        contents = self.fs.cat(paths)
        return [(np.frombuffer(contents[p], dtype=np.uint8), self.labels[i]) for p, i in zip(paths, indices)]


class ProcessLocalFiles(StoreFiles):
    """`StoreFiles` that opens its own fsspec filesystem in each loader worker process
    (an async fsspec filesystem may not cross a fork)."""

    def __getitems__(self, indices):
        if getattr(self, "_pid", None) != os.getpid():
            self.fs = fsspec.core.url_to_fs(self.urls[0])[0]
            self._pid = os.getpid()
        return super().__getitems__(indices)


class NodeCachedFiles(StoreFiles):
    """The same, with a per-node cache that fills and never evicts (Monarch's policy)
    and no sharing between nodes."""

    def __init__(self, urls, capacity: int, labels=None):
        super().__init__(urls, labels)
        self.capacity = capacity
        self.used = 0
        self.cache = {}
        self._lock = threading.Lock()

    def __getitems__(self, indices):
        missing = [i for i in indices if i not in self.cache]
        fetched = dict(zip(missing, super().__getitems__(missing))) if missing else {}
        out = []
        for i in indices:
            item = self.cache.get(i) or fetched[i]
            with self._lock:
                if i in fetched and i not in self.cache and self.used + item[0].nbytes <= self.capacity:
                    self.cache[i] = item
                    self.used += item[0].nbytes
            out.append(item)
        return out


def collate(items):
    data = np.empty(len(items), dtype=object)
    data[:] = [d for d, _ in items]
    return {"data": data, "label": np.array([lbl for _, lbl in items])}


def torch_epoch_loader(dataset, rank: int, world: int, batch_size: int, epoch: int, seed: int = 0,
                       num_workers: int = 0):
    """DataLoader + DistributedSampler, as in PyTorch's DDP tutorial."""
    import torch.utils.data

    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world, rank=rank,
                                                              shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                       num_workers=num_workers, collate_fn=collate)
