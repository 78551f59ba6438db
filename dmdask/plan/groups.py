"""Load groups (issue 41): one Dask task stands for `size` consecutive blocks of a
dataset's load order, so the scheduler holds one task state (~4 KiB and ~100-200 us of
its CPU, Dask's own floor) per group, not per block. Each block is still kept under its
own block key in its worker's cache (`dmdask.worker.tiers.TieredStore`), so the row
channel, the same-host layouts and the ranks' requests name blocks as before; only the
scheduler and the claimant's submission see groups.

Pure numpy, shared by the scheduler plugin and the client: both derive a dataset's groups
from its number of blocks (`group_size`) and its load order, so no message carries them.

Guarantees: every block is in exactly one group; group g holds the blocks at positions
g*size .. (g+1)*size-1 of the load order (the last one fewer), so the blocks an epoch
needs first are in the first groups; `of` and `members` are O(1) and O(size).
"""
from __future__ import annotations

import numpy as np

GROUP_KEY_PREFIX = "dmdask-group-"
GROUP_BLOCKS = 16  # blocks a load task stands for, in datasets of `GROUP_FROM_BLOCKS` blocks and more
GROUP_FROM_BLOCKS = 16384  # below this, one task per block: the scheduler's cost is small, and a load
# failing or a worker lost touches one block, not its group


def group_size(num_blocks: int, lazy: bool = False) -> int:
    """The blocks one load task stands for in a dataset of `num_blocks` (1: a task per
    block; always 1 for lazy datasets, whose blocks are submitted one by one as read)."""
    return GROUP_BLOCKS if not lazy and num_blocks >= GROUP_FROM_BLOCKS else 1


def group_key(identity: str, g: int) -> str:
    """The Dask key of group g of a dataset: the same for every rank and every job."""
    return f"{GROUP_KEY_PREFIX}{identity}-{g}"


def parse_group_key(key) -> tuple[str, int] | None:
    """(identity, group number) of a group key; None for any other key."""
    if not isinstance(key, str) or not key.startswith(GROUP_KEY_PREFIX):
        return None
    identity, _, index = key[len(GROUP_KEY_PREFIX):].rpartition("-")
    return (identity, int(index)) if index.isdigit() else None


class Groups:
    """The groups of a dataset of `num_blocks` blocks loaded in `order` (a permutation of
    the blocks; None: index order), `size` blocks each. 8 bytes per block."""

    def __init__(self, num_blocks: int, order, size: int):
        self.num_blocks, self.size = int(num_blocks), int(size)
        self.order = (np.arange(num_blocks, dtype=np.int32) if order is None
                      else np.asarray(order, dtype=np.int32))
        if len(self.order) != self.num_blocks:
            raise ValueError(f"a load order of {len(self.order)} blocks for a dataset of {num_blocks}")
        self.position = np.empty(self.num_blocks, dtype=np.int32)
        self.position[self.order] = np.arange(self.num_blocks, dtype=np.int32)

    @property
    def count(self) -> int:
        return -(-self.num_blocks // self.size)

    def of(self, k: int) -> int:
        """The group of block k."""
        return int(self.position[k]) // self.size

    def members(self, g: int) -> list[int]:
        """The blocks of group g, in load order."""
        return self.order[g * self.size:(g + 1) * self.size].tolist()

    def first(self, g: int) -> int:
        """Group g's first block (its planned worker and load priority are the group's)."""
        return int(self.order[g * self.size])
