"""`Feistel`: a keyed permutation of range(size), evaluated per value in O(1) time and memory.

A balanced Feistel network over the smallest power of 4 >= size, with cycle-walking to
stay inside range(size). The same keys give the same permutation on any machine
(fixed-width integer arithmetic; keys from numpy's `SeedSequence`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import numpy.random  # noqa: F401 - numpy imports it lazily, on the first epoch's order (12 ms)

ROUNDS = 6  # Feistel rounds; 4 already make a strong pseudo-random permutation (Luby-Rackoff)
# Values a permutation pass takes at a time: its ~30 temporaries of 64 KiB come from the
# heap and are reused, where arrays of 256 KiB were each a new mapping (glibc maps blocks
# of 128 KiB and more), faulted in and unmapped again: 9,500 page faults an epoch of
# 160,000 samples, ~20% of a warm epoch's time.
_SLICE = 1 << 13

_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_SHIFT30, _SHIFT27, _SHIFT31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, applied in place to a uint64 array and returned.

    A bijection of uint64 in which every input bit affects every output bit. (Integer
    arrays wrap around silently in numpy: no overflow warning to silence.)
    """
    z ^= z >> _SHIFT30
    z *= _MUL1
    z ^= z >> _SHIFT27
    z *= _MUL2
    z ^= z >> _SHIFT31
    return z


def round_keys(seed: int, epoch: int, salt: int, count: int, stream: Sequence[int] = ()) -> np.ndarray:
    return np.random.SeedSequence([seed, epoch, salt, *stream]).generate_state(count, dtype=np.uint64)


class Feistel:
    """A keyed permutation of range(size): a balanced Feistel network with cycle-walking.

    The network permutes the smallest power of 4 >= size (two halves of `half_bits` bits).
    An image >= size is fed through the network again until it lands inside range(size),
    which keeps the map a bijection of range(size). A `tweak` (one uint64 per value, or
    None) selects one of many unrelated permutations that share the round keys.
    """

    def __init__(self, size: int, round_keys: np.ndarray):
        self.size = size
        half_bits = ((size - 1).bit_length() + 1) // 2 if size > 1 else 0
        self._shift = np.uint64(half_bits)
        self._mask = np.uint64((1 << half_bits) - 1)
        self._keys = round_keys

    def forward(self, values: np.ndarray, tweak: Optional[np.ndarray] = None) -> np.ndarray:
        """The images of `values` (a uint64 array within range(size)), as a new array."""
        return self._cycle_walk(self.encrypt, values, tweak)

    def backward(self, values: np.ndarray, tweak: Optional[np.ndarray] = None) -> np.ndarray:
        """The preimages of `values`: backward(forward(v, t), t) == v."""
        return self._cycle_walk(self._decrypt, values, tweak)

    def _cycle_walk(self, network, values, tweak):
        if self.size <= 1:
            return values.copy()
        if len(values) > _SLICE:  # in slices, so the temporaries stay small (see _SLICE)
            out = np.empty_like(values)
            for at in range(0, len(values), _SLICE):
                part = slice(at, at + _SLICE)
                out[part] = self._cycle_walk(network, values[part], None if tweak is None else tweak[part])
            return out
        out = network(values, tweak)
        outside = np.flatnonzero(out >= self.size)
        while outside.size:  # ends: each value's cycle in the network re-enters range(size)
            out[outside] = network(out[outside], None if tweak is None else tweak[outside])
            outside = outside[out[outside] >= self.size]
        return out

    def encrypt(self, values: np.ndarray, tweak: Optional[np.ndarray]) -> np.ndarray:
        """One pass through the network, without cycle-walking: a permutation of the
        power of 4 that holds range(size), for callers that walk to a bound of their own."""
        left, right = values >> self._shift, values & self._mask
        for key in self._keys:
            mixed = self._round(right, key, tweak)
            mixed ^= left
            left, right = right, mixed
        return (left << self._shift) | right

    def _decrypt(self, values, tweak):
        left, right = values >> self._shift, values & self._mask
        for key in self._keys[::-1]:
            mixed = self._round(left, key, tweak)
            mixed ^= right
            left, right = mixed, left
        return (left << self._shift) | right

    def _round(self, half, key, tweak):
        z = half ^ key
        if tweak is not None:
            z ^= tweak
        z = mix64(z)
        z &= self._mask
        return z
