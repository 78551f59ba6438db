"""Elastic resume: the rest of an epoch after ranks of another world size stopped part-way.

The positions none of a generation's ranks handed out form the `Remaining` sequence,
which the next generation's ranks deal among themselves as `RankShare` deals an epoch.
Each resumed state records the consumed counts of the generations before it (`history`).

Guarantees: over all generations of an epoch, every position is handed out exactly
once (with drop_last=True, the tail of the last generation that does not fill a batch
on every rank goes to none). Memory is O(positions in the ranks' skew): ranks that
stopped within a few batches of each other cost a few batches of int64, whatever n.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Remaining:
    """A sequence of epoch positions: `head` (explicit), then tail_start..n-1."""

    def __init__(self, n: int, head: np.ndarray = None, tail_start: int = 0):
        self.n = int(n)
        self.head = np.zeros(0, dtype=np.int64) if head is None else np.asarray(head, dtype=np.int64)
        self.tail_start = int(tail_start)

    def __len__(self) -> int:
        return len(self.head) + self.n - self.tail_start

    def at(self, indices: np.ndarray) -> np.ndarray:
        """The positions at these indices of the sequence (int64)."""
        indices = np.asarray(indices, dtype=np.int64)
        if not len(self.head):
            return indices + self.tail_start
        in_head = indices < len(self.head)
        out = indices + (self.tail_start - len(self.head))
        out[in_head] = self.head[indices[in_head]]
        return out

    def after(self, world_size: int, consumed: Sequence[int]) -> "Remaining":
        """The positions left once rank r of `world_size` (dealt indices r, r + world_size,
        ...) handed out its first consumed[r] of them."""
        consumed = np.asarray(consumed, dtype=np.int64)
        low, high = int(consumed.min()), int(consumed.max())
        w = world_size
        # below w*low every index is consumed, from w*high on none is; between, index i
        # (round i // w of rank i % w) is left when that rank had not reached that round
        between = np.arange(w * low, min(w * high, len(self)), dtype=np.int64)
        left = between[between // w >= consumed[between % w]]
        cut = w * high
        head = self.at(left)
        if cut < len(self.head):
            head = np.concatenate([head, self.head[cut:]])
        tail_start = self.tail_start + max(0, cut - len(self.head))
        return Remaining(self.n, head, min(tail_start, self.n))


def remaining(n: int, history: list[dict]) -> Remaining:
    """The sequence the current generation deals: the epoch's positions minus those the
    generations in `history` handed out ({"world_size", "consumed"} each, in order)."""
    seq = Remaining(n)
    for generation in history:
        seq = seq.after(int(generation["world_size"]), generation["consumed"])
    return seq
