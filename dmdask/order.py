"""The order of an epoch and each rank's share of it: pure functions of the spec.

Guarantees: the order depends only on (seed, epoch, shuffle, shuffle_window, block
bounds), never on the cluster, the cache or the number of ranks. The ranks' shares
partition the epoch: every sample goes to exactly one rank (with `drop_last=True`, the
tail that does not fill a batch on every rank goes to none).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np


def epoch_order(bounds: np.ndarray, epoch: int, shuffle: bool, seed: int,
                shuffle_window: Optional[int]) -> np.ndarray:
    """Global sample ids of one epoch, in the order they are consumed."""
    n = int(bounds[-1])
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    num_blocks = len(bounds) - 1
    if shuffle_window is None or shuffle_window >= num_blocks:
        return rng.permutation(n).astype(np.int64)
    pieces = []
    block_order = rng.permutation(num_blocks)
    for w in range(0, num_blocks, shuffle_window):
        ids = np.concatenate([np.arange(bounds[b], bounds[b + 1], dtype=np.int64)
                              for b in block_order[w:w + shuffle_window]])
        pieces.append(ids[rng.permutation(len(ids))])
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def rank_batches(order: np.ndarray, rank: int, world_size: int, batch_size: int,
                 drop_last: bool) -> List[np.ndarray]:
    """This rank's batches: sample ids rank, rank + world_size, ... of the epoch order.

    Interleaving keeps all ranks at the same point of the epoch, so a block of a
    shuffle window is wanted by every rank at about the same time.
    """
    share = order[rank::world_size]
    if drop_last:
        per_rank = (len(order) // (world_size * batch_size)) * batch_size
        share = share[:per_rank]
    return [share[i:i + batch_size] for i in range(0, len(share), batch_size)]
