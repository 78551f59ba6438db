"""`Windows`: the order of a shuffle-window epoch (`EpochOrder(shuffle_window=k)`), O(1) per value.

The blocks are permuted by a network of their own, the permuted block sequence is cut
into windows of k blocks, and the samples of each window are permuted among themselves by
a network tweaked by the window index: a window's positions cover exactly the samples of
its blocks.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .feistel import ROUNDS, Feistel, mix64, round_keys

_BLOCK_SALT = 0x626C6F636B  # "block": keys of the block permutation
_WINDOW_SALT = 0x77696E646F  # "windo": keys of the in-window permutations


def _through_table(function, values: np.ndarray) -> np.ndarray:
    """function(values) for int64 values, evaluated once per distinct value when they span fewer
    values than there are (the slots or windows of a batch), else once per value."""
    if len(values) == 0:
        return function(values)
    low, high = int(values.min()), int(values.max())
    if high - low + 1 >= len(values):
        return function(values)
    return function(np.arange(low, high + 1, dtype=np.int64))[values - low]


class Windows:
    """Position <-> (window, offset) <-> sample id.

    Slot s of the permuted block sequence holds block `blocks.forward(s)`; window w holds
    slots w*k .. min(B, (w+1)*k) - 1, so w*k*block_len samples precede it, less `deficit`
    (the samples the last block, B-1, lacks) when w comes after the window holding that
    short block. Its slot is found once, with the inverse block permutation.
    """

    def __init__(self, num_samples: int, block_len: int, window_blocks: int, seed: int, epoch: int,
                 stream: Sequence[int] = ()):
        self.block_len = block_len
        self.window_blocks = k = window_blocks
        self.num_blocks = -(-num_samples // block_len)
        self.window_len = k * block_len  # samples in a window of k whole blocks
        self.deficit = self.num_blocks * block_len - num_samples
        self.blocks = Feistel(self.num_blocks, round_keys(seed, epoch, _BLOCK_SALT, ROUNDS, stream))
        keys = round_keys(seed, epoch, _WINDOW_SALT, ROUNDS + 1, stream)
        self._window_keys, self._tweak_salt = keys[:ROUNDS], keys[ROUNDS]
        last_block = np.array([self.num_blocks - 1], dtype=np.uint64)
        self.short_slot = int(self.blocks.backward(last_block)[0])
        self.short_window = self.short_slot // k
        # past this position, windows start `deficit` earlier than whole blocks would put them
        self._short_window_end = int(self.window_start(self.short_window) + self.window_size(self.short_window))
        # offsets of the short window at or past this one lie after the short block
        self._after_short_block = (self.short_slot - self.short_window * k + 1) * block_len - self.deficit
        last_window = (self.num_blocks - 1) // k
        self._sizes = sorted({self.window_len, int(self.window_size(self.short_window)),
                              int(self.window_size(last_window))})  # of all windows

    def window_start(self, windows):
        return windows * self.window_len - self.deficit * (windows > self.short_window)

    def window_size(self, windows):
        blocks = np.minimum(self.window_blocks, self.num_blocks - windows * self.window_blocks)
        return blocks * self.block_len - self.deficit * (windows == self.short_window)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        virtual = positions + self.deficit * (positions >= self._short_window_end)
        windows, offsets = np.divmod(virtual, self.window_len)
        offsets = self._permute_within(windows, offsets, inverse=False)
        # as if the short block were whole: offsets past it move up by `deficit`
        offsets += self.deficit * ((windows == self.short_window) & (offsets >= self._after_short_block))
        slot_in_window, in_block = np.divmod(offsets, self.block_len)
        slots = windows * self.window_blocks + slot_in_window
        blocks = _through_table(self._block_at, slots)
        return blocks * self.block_len + in_block

    def positions(self, ids: np.ndarray) -> np.ndarray:
        blocks, in_block = np.divmod(ids, self.block_len)
        slots = _through_table(self._slot_of, blocks)
        windows, slot_in_window = np.divmod(slots, self.window_blocks)
        offsets = slot_in_window * self.block_len + in_block
        offsets -= self.deficit * ((windows == self.short_window) & (slots > self.short_slot))
        return self.window_start(windows) + self._permute_within(windows, offsets, inverse=True)

    def _block_at(self, slots):
        return self.blocks.forward(slots.astype(np.uint64)).astype(np.int64)

    def _slot_of(self, blocks):
        return self.blocks.backward(blocks.astype(np.uint64)).astype(np.int64)

    def _tweak(self, windows):
        return mix64(windows.astype(np.uint64) ^ self._tweak_salt)  # distinct per window

    def _permute_within(self, windows, offsets, inverse: bool):
        """Each offset permuted within its window (int64 in, int64 out)."""
        tweaks = _through_table(self._tweak, windows)
        sizes = _through_table(self.window_size, windows)
        out = np.empty_like(offsets)
        for size in self._sizes:  # at most 3: whole, the short block's, the last
            chosen = np.flatnonzero(sizes == size)
            if len(chosen) == 0:
                continue
            network = Feistel(size, self._window_keys)
            permute = network.backward if inverse else network.forward
            out[chosen] = permute(offsets[chosen].astype(np.uint64), tweaks[chosen])
        return out
