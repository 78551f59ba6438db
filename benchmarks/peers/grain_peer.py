"""Peer: Grain's DataLoader with an IndexSampler over each sample's file on the HTTP store.

Grain's own format, ArrayRecord, opens local (or GCS) paths only, so the data source here
reads sample files over HTTP: Grain has no cache of its own."""
from __future__ import annotations

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
            f"num_epochs=1, seed=epoch)`; `DataLoader(operations=[Batch({cfg['batch']}, batch_fn=list)], "
            f"worker_count={cfg['loader_workers']})`, one per epoch; a `RandomAccessDataSource` that GETs a "
            "sample's file (ArrayRecord reads local paths only)")


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
    def __init__(self, ctx: dict):
        self.ctx = ctx
        self.source = HttpFiles(ctx["file_urls"])

    def epoch(self, epoch: int):
        import grain.python as grain

        c = self.ctx
        sampler = grain.IndexSampler(num_records=len(self.source), shuffle=True, num_epochs=1,
                                     seed=c["seed"] + epoch,
                                     shard_options=grain.ShardOptions(shard_index=c["rank"], shard_count=c["world"],
                                                                      drop_remainder=False))
        return grain.DataLoader(data_source=self.source, sampler=sampler, worker_count=c["loader_workers"],
                                operations=[grain.Batch(batch_size=c["batch"], drop_remainder=False, batch_fn=list)])

    ids = staticmethod(batch_ids)

    def close(self):
        pass
