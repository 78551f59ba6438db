"""What every source layout has in common: a dataset's description and its block readers.

A dataset is `num_samples` samples cut into blocks of `block_len` consecutive samples
(the last block may be shorter): block k holds samples k*block_len .. min(n, (k+1)*block_len)-1.
`DatasetInfo` is all a training process needs to plan an epoch; a `BlockReader` is
the small picklable object a worker uses to read one block from the shared store.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional, Tuple

import numpy as np

from ..errors import BlockReadError

BLOCK_KEY_PREFIX = "dmdask-block-"


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """A dataset as the training process sees it. Small (no per-block or per-sample arrays).

    name: the registry name, a function of the spec alone (URL, options, fields, block
        size); identity: a token of the data as opened (Zarr metadata, a folder's
        listing), part of every block key, so a dataset changed and released gets new blocks; nbytes: decoded bytes of the
        whole dataset, None when the store's listing gives no sizes (HTTP folders).
    """

    name: str
    identity: str
    url: str
    fields: Tuple[str, ...]
    num_samples: int
    block_len: int
    nbytes: Optional[int]

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.block_len)

    def block_range(self, k: int) -> Tuple[int, int]:
        """Samples start..stop-1 of block k."""
        start = k * self.block_len
        return start, min(self.num_samples, start + self.block_len)

    def block_of(self, sample_ids: np.ndarray) -> np.ndarray:
        """The block index of each sample id."""
        return np.asarray(sample_ids, dtype=np.int64) // self.block_len

    def block_key(self, k: int) -> str:
        return block_key(self.identity, k)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DatasetInfo":
        return cls(**{**d, "fields": tuple(d["fields"])})


def block_key(identity: str, index: int) -> str:
    """The Dask key of a block: the same for every rank and every job."""
    return f"{BLOCK_KEY_PREFIX}{identity}-{index}"


def parse_block_key(key) -> Optional[Tuple[str, int]]:
    """(identity, index) of a block key; None for any other key."""
    if not isinstance(key, str) or not key.startswith(BLOCK_KEY_PREFIX):
        return None
    identity, _, index = key[len(BLOCK_KEY_PREFIX):].rpartition("-")
    return (identity, int(index)) if index.isdigit() else None


def is_block_key(key) -> bool:
    return parse_block_key(key) is not None


def options_json(options) -> str:
    """Storage options as a canonical string (hashable, picklable)."""
    return json.dumps(options or {}, sort_keys=True, default=str)


class BlockReader:
    """Reads one block from the shared store. Picklable and small.

    nbytes: the block's decoded size, or None when it is known only once read.
    row_granular: True when `read_rows` reads only the wanted samples from the store
    (one file per sample); False when the store's unit is the whole block (Zarr chunks).
    """

    key: str
    index: int
    start: int
    stop: int
    nbytes: Optional[int]
    url: str
    row_granular = False

    def read(self):  # pragma: no cover - interface
        """The whole block as a `dmdask.worker.holdings.Block`; `BlockReadError` on failure."""
        raise NotImplementedError

    def read_rows(self, rows):  # pragma: no cover - interface
        """Only the given rows (offsets in the block), for row-granular readers."""
        raise NotImplementedError

    def fail(self, exc: BaseException) -> BlockReadError:
        return BlockReadError(self.url, self.index, self.start, self.stop, exc)


class Source:
    """An opened dataset in the process that creates its blocks: `info` plus `reader(k)`."""

    info: DatasetInfo

    def reader(self, k: int) -> BlockReader:  # pragma: no cover - interface
        raise NotImplementedError
