"""`Feistel`: a keyed permutation of range(size), evaluated per value in O(1) time and memory.

A Feistel network over the smallest power of 2 >= size, with cycle-walking to stay inside
range(size): the value's bits are cut into a high and a low half (the high one a bit longer
for an odd number of bits), and each round changes one half from a keyed hash of the other,
in turn. The domain is less than twice the size, so a value takes fewer than 2 passes on
average (a balanced network needs a power of 4: up to 4). The same keys give the same permutation on any machine
(fixed-width integer arithmetic; keys from numpy's `SeedSequence`).

A round's hash is multiply-add-shift (Dietzfelbinger's universal family): the top bits of
`(half ^ tweak) * a + b` modulo 2**64, `a` odd and `b` from the round's key. Four numpy
passes a round, in place: a third of splitmix64's (`mix64`), which a rank's shuffled ids
spent 0.03 CPU-seconds per GB of 3 KB rows on (order version 3).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.random  # noqa: F401 - now, not lazily at the first epoch's order

ROUNDS = 6  # Feistel rounds; 4 already make a strong pseudo-random permutation (Luby-Rackoff)
# values a permutation pass takes at a time: its temporaries of 64 KiB stay below glibc's
# mmap threshold (128 KiB), so they are reused from the heap rather than mapped and unmapped
_SLICE = 1 << 13

_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_SHIFT30, _SHIFT27, _SHIFT31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (a bijection of uint64), applied in place to a uint64 array and returned."""
    z ^= z >> _SHIFT30
    z *= _MUL1
    z ^= z >> _SHIFT27
    z *= _MUL2
    z ^= z >> _SHIFT31
    return z


def round_keys(seed: int, epoch: int, salt: int, count: int, stream: Sequence[int] = ()) -> np.ndarray:
    return np.random.SeedSequence([seed, epoch, salt, *stream]).generate_state(count, dtype=np.uint64)


class Feistel:
    """A keyed permutation of range(size) (see the module). A `tweak` (one uint64 per value,
    or None) selects one of many unrelated permutations that share the round keys."""

    def __init__(self, size: int, round_keys: np.ndarray):
        self.size = size
        bits = (size - 1).bit_length() if size > 1 else 0
        self._low_bits = np.uint64(bits // 2)
        self._low = np.uint64((1 << (bits // 2)) - 1)  # mask of the low half
        # a round's hash keeps the top bits of its product: as many as the half it changes has
        self._shifts = (np.uint64(64 - (bits - bits // 2)), np.uint64(64 - bits // 2))  # even, odd rounds
        keys = np.asarray(round_keys, dtype=np.uint64)
        self._multipliers = keys | np.uint64(1)
        self._addends = mix64(keys.copy())

    def forward(self, values: np.ndarray, tweak: np.ndarray | None = None) -> np.ndarray:
        """The images of `values` (a uint64 array within range(size)), as a new array."""
        return self._cycle_walk(self.encrypt, values, tweak)

    def backward(self, values: np.ndarray, tweak: np.ndarray | None = None) -> np.ndarray:
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

    def encrypt(self, values: np.ndarray, tweak: np.ndarray | None) -> np.ndarray:
        """One pass through the network, without cycle-walking: a permutation of the
        power of 2 that holds range(size), for callers that walk to a bound of their own."""
        return self._network(values, tweak, range(len(self._multipliers)))

    def _decrypt(self, values, tweak):
        return self._network(values, tweak, range(len(self._multipliers) - 1, -1, -1))

    def _network(self, values, tweak, rounds) -> np.ndarray:
        high, low = values >> self._low_bits, values & self._low
        hashed = np.empty_like(high)
        for i in rounds:  # even rounds change the high half from the low one, odd rounds the low half
            source, target = (high, low) if i % 2 else (low, high)
            shift = self._shifts[i % 2]
            if shift == 64:  # a half of no bits (a domain of 2)
                continue
            if tweak is None:
                np.multiply(source, self._multipliers[i], out=hashed)
            else:
                np.bitwise_xor(source, tweak, out=hashed)
                hashed *= self._multipliers[i]
            hashed += self._addends[i]
            hashed >>= shift
            target ^= hashed
        high <<= self._low_bits
        high |= low
        return high
