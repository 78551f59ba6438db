"""Peer: Grain's DataLoader with an IndexSampler over each sample's file on the HTTP store.

Grain's own format, ArrayRecord, opens local (or GCS) paths only, so the data source here
reads sample files over HTTP: Grain has no cache of its own."""
from __future__ import annotations

import itertools
import os

import numpy as np

from .dataset import sample_id

NAME, LABEL, FORMAT, STORE = "grain", "Grain DataLoader", "files", "http"
CAN = {"exactly_once": "yes: IndexSampler shards the record range (drop_remainder=False)",
       "cache": "none: every epoch reads the store", "shared_cache": "no cache"}


def available():
    try:
        import grain.python  # noqa: F401
    except ImportError as exc:
        return f"grain is not importable: {exc} (make bench-peers installs it)"
    return None


def settings(cfg: dict) -> str:
    return ("`IndexSampler(num_records, ShardOptions(rank, world, drop_remainder=False), shuffle=True, "
            f"num_epochs=<epochs>, seed=0)`; one `DataLoader(operations=[Batch({cfg['batch']}, batch_fn=list)], "
            f"worker_count={cfg['loader_workers']})` over all epochs; a data source that GETs a sample's file "
            "(ArrayRecord, Grain's format, reads local paths only)")


class HttpFiles:
    """A Grain random-access data source: record i is file i's bytes (its own fsspec per process)."""

    def __init__(self, urls):
        self.urls = list(urls)
        self._fs, self._pid = None, None

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, i):
        if self._pid != os.getpid():
            import fsspec

            self._fs, self._pid = fsspec.filesystem("http"), os.getpid()
        return self._fs.cat_file(self.urls[int(i)])

    def __getstate__(self):
        return {"urls": self.urls}

    def __setstate__(self, state):
        self.__init__(state["urls"])


def batch_ids(batch) -> np.ndarray:
    return np.array([sample_id(d) for d in batch], dtype=np.int64)


class Loader:
    """One DataLoader over all epochs (its worker processes start once); an epoch is the next
    ceil(shard / batch) batches, exact when the shard divides into batches (the presets' do)."""

    def __init__(self, ctx: dict):
        import grain.python as grain

        n, world, rank = ctx["samples"], ctx["world"], ctx["rank"]
        sampler = grain.IndexSampler(num_records=n, shuffle=True, num_epochs=ctx["epochs"], seed=ctx["seed"],
                                     shard_options=grain.ShardOptions(shard_index=rank, shard_count=world,
                                                                      drop_remainder=False))
        self.loader = grain.DataLoader(
            data_source=HttpFiles(ctx["file_urls"]), sampler=sampler, worker_count=ctx["loader_workers"],
            operations=[grain.Batch(batch_size=ctx["batch"], drop_remainder=False, batch_fn=list)])
        self.iterator = iter(self.loader)
        shard = n // world + (1 if rank < n % world else 0)
        self.per_epoch = -(-shard // ctx["batch"])

    def epoch(self, epoch: int):
        return itertools.islice(self.iterator, self.per_epoch)

    ids = staticmethod(batch_ids)

    def close(self):
        pass
