"""The order of a mixture epoch (`dmdask.Mix`): which source, and which of its samples, at each position.

Source `i` takes exactly `counts[i]` of the epoch's `N` positions (`apportion`).
`MixOrder` maps each position to a *global id*, `offsets[i] + sample id` (the sources'
sample ids laid end to end), so that `RankShare` and `dmdask.plan.elastic` deal it unchanged.

Guarantees:

- A bijection from positions 0..N-1 to draws (source i, k), 0 <= k < counts[i].
- Draws become samples in *passes*: draw k of epoch e is the source's draw e*counts[i] + k,
  and every run of n_i consecutive draws (pass p = draw // n_i) is a permutation of the
  source's n_i samples (`EpochOrder` keyed by (seed, pass, source)): no sample repeats
  within a pass.
- Spread: each round of fewer than `MIX_ROUND` positions (with up to 32 sources) holds
  every source's share to within one, and a source's draws come in order from round to
  round (docs/architecture.md, "An epoch of a mixture").
- Everything is a function of (sizes, counts, block_lens, shuffle, seed, epoch,
  shuffle_window) alone, in fixed-width integer arithmetic, O(log S) time per position
  and O(S) per round and per source touched: nothing is materialised over the epoch.
"""
from __future__ import annotations

from fractions import Fraction
from collections.abc import Sequence

import numpy as np

from .feistel import ROUNDS, Feistel, mix64, round_keys
from .order import EpochOrder, check_int, check_positions

MIX_ROUND = 64  # at most this many positions a round (with up to 32 sources): where the weights hold to within one
_MAX_ROUNDS = 1 << 31  # keeps r * (count % rounds) within int64
_MIX_SALT = 0x6D69786564  # "mixed": keys of the in-round permutations
_ORDERS_KEPT = 1024  # (source, pass) orders kept between calls (a few hundred bytes each)
_PIECE = 1 << 20  # sources x positions evaluated at a time


def apportion(total: int, weights: Sequence) -> list[int]:
    """`total` split in proportion to `weights` (non-negative numbers, positive sum):
    each gets the integer part of its exact quota, and the units left go to the largest
    remainders (ties: the first). Exact (rational arithmetic), so the same everywhere; a
    zero weight gets 0, and quotas that are whole numbers are met exactly."""
    total = check_int("total", total, 0)
    exact = [Fraction(w) for w in weights]
    if not exact or any(w < 0 for w in exact) or sum(exact) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)!r}")
    whole = sum(exact)
    quotas = [total * w / whole for w in exact]
    counts = [q.numerator // q.denominator for q in quotas]
    left = total - sum(counts)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return counts


class MixOrder:
    """Positions 0..N-1 of one mixture epoch -> global ids (see the module's guarantees);
    N = sum(counts), each source's draws this epoch."""

    def __init__(self, sizes: Sequence[int], counts: Sequence[int], block_lens: Sequence[int], *, shuffle: bool,
                 seed: int, epoch: int, shuffle_window: int | None = None):
        self.sizes = [check_int("size", n, 1) for n in sizes]
        self.counts = [check_int("count", c, 0) for c in counts]
        self.block_lens = [check_int("block_len", b, 1) for b in block_lens]
        if not self.sizes or not len(self.sizes) == len(self.counts) == len(self.block_lens):
            raise ValueError("sizes, counts and block_lens must be non-empty lists of one length, got "
                             f"{len(self.sizes)}, {len(self.counts)} and {len(self.block_lens)}")
        self.num_samples = n = sum(self.counts)
        if n >= 2**62 or sum(self.sizes) >= 2**62:
            raise ValueError("a mixture must have fewer than 2**62 positions and samples")
        self.shuffle = bool(shuffle)
        self.seed = check_int("seed", seed, 0)
        self.epoch = check_int("epoch", epoch, 0)
        self.shuffle_window = shuffle_window
        self.offsets = np.cumsum([0] + self.sizes).astype(np.int64)  # global id of each source's sample 0
        s = len(self.sizes)
        # a round's length differs from n / rounds by less than s: rounds of at most `longest`
        # (a power of 4, so a power of 2: the domain of one Feistel network) with at least 32 positions on average
        longest = MIX_ROUND
        while longest - s < 32:
            longest *= 4
        round_len = max(longest - s, -(-n // _MAX_ROUNDS))
        self.num_rounds = q = max(1, -(-n // round_len))
        self._whole = np.array([c // q for c in self.counts], dtype=np.int64)[:, None]
        self._part = np.array([c % q for c in self.counts], dtype=np.int64)[:, None]
        self._phase = np.array([i * q // s for i in range(s)], dtype=np.int64)[:, None]
        keys = round_keys(self.seed, self.epoch, _MIX_SALT, ROUNDS + 1)
        self._network = Feistel(round_len + s, keys[:ROUNDS])  # permutes every round (cycle-walking to its length)
        self._tweak_salt = keys[ROUNDS]
        # where this epoch's draws start in each source's passes: (pass, draw in it)
        self._start = [divmod(self.epoch * c, size) for c, size in zip(self.counts, self.sizes)]
        self._orders: dict[tuple[int, int], EpochOrder] = {}

    # -- positions -> draws ---------------------------------------------------------------
    def draws_before(self, rounds: np.ndarray) -> np.ndarray:
        """(S, len(rounds)) int64: each source's draws in the rounds before these."""
        return rounds * self._whole + (rounds * self._part + self._phase) // self.num_rounds

    def draws(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(source, k) of each position: the k-th draw of that source in this epoch."""
        flat, shape = check_positions(positions, self.num_samples)
        sources = np.empty(len(flat), dtype=np.int64)
        ks = np.empty(len(flat), dtype=np.int64)
        piece = max(1, _PIECE // len(self.sizes))
        for at in range(0, len(flat), piece):
            sources[at:at + piece], ks[at:at + piece] = self._draws(flat[at:at + piece])
        return sources.reshape(shape), ks.reshape(shape)

    def _draws(self, p: np.ndarray):
        n, q, s = self.num_samples, self.num_rounds, len(self.sizes)
        r = np.clip((p * (q / n)).astype(np.int64), 0, q - 1)  # about right; corrected below
        while True:  # computed per distinct round: a rank's positions fall in fewer rounds than they are
            rounds, which = np.unique(r, return_inverse=True)
            starts = self.draws_before(rounds).sum(axis=0)
            behind = p < starts[which]
            ahead = p >= self.draws_before(rounds + 1).sum(axis=0)[which]
            if not (behind.any() or ahead.any()):
                break
            r = r - behind + ahead
        before = self.draws_before(rounds)  # (S, rounds): each source's draws before the round
        per_source = self.draws_before(rounds + 1) - before  # ... and in it
        ends = np.cumsum(per_source, axis=0)  # a round's slots: source 0's, then source 1's, ...
        slot = p - starts[which]
        if self.shuffle:
            slot = self._permute_in_round(r, slot, ends[-1][which])
        # the source of each slot: the first whose end passes it, found in all rounds' ends at once
        span = int(ends[-1].max()) + 1
        table = (ends + np.arange(len(rounds)) * span).T.ravel()  # ascending: round by round, source by source
        at = np.searchsorted(table, which * span + slot, side="right")
        sources = at - which * s
        ks = before.T.ravel()[at] + slot - (ends - per_source).T.ravel()[at]
        return sources, ks

    def _permute_in_round(self, rounds, slots, lengths):
        """Each slot permuted within its round (a network tweaked by the round, walked to the round's length)."""
        tweaks = mix64(rounds.astype(np.uint64) ^ self._tweak_salt)
        lengths = lengths.astype(np.uint64)
        out = self._network.encrypt(slots.astype(np.uint64), tweaks)
        outside = np.flatnonzero(out >= lengths)
        while outside.size:  # ends: each value's cycle in the network re-enters range(length)
            out[outside] = self._network.encrypt(out[outside], tweaks[outside])
            outside = outside[out[outside] >= lengths[outside]]
        return out.astype(np.int64)

    # -- draws -> samples ------------------------------------------------------------------
    def ids(self, positions) -> np.ndarray:
        """int64 global ids at these positions: offsets[source] + the sample id in it."""
        sources, ks = self.draws(positions)
        flat_sources, flat_ks = sources.ravel(), ks.ravel()
        out = np.empty(len(flat_ks), dtype=np.int64)
        for source in np.unique(flat_sources).tolist():
            chosen = np.flatnonzero(flat_sources == source)
            out[chosen] = self.offsets[source] + self.samples(source, flat_ks[chosen])
        return out.reshape(sources.shape)

    def samples(self, source: int, ks: np.ndarray) -> np.ndarray:
        """The sample ids (in the source) of its draws `ks` of this epoch."""
        size = self.sizes[source]
        first_pass, first_draw = self._start[source]
        passes, in_pass = np.divmod(first_draw + np.asarray(ks, dtype=np.int64), size)
        out = np.empty(len(in_pass), dtype=np.int64)
        for extra in np.unique(passes).tolist():
            chosen = np.flatnonzero(passes == extra)
            out[chosen] = self.order(source, first_pass + extra).ids(in_pass[chosen])
        return out

    def order(self, source: int, pass_: int) -> EpochOrder:
        """The order of a pass over a source: its own permutation of the source's samples."""
        key = (source, pass_)
        found = self._orders.get(key)
        if found is None:
            if len(self._orders) >= _ORDERS_KEPT:
                self._orders.pop(next(iter(self._orders)))
            found = self._orders[key] = EpochOrder(
                self.sizes[source], self.block_lens[source], shuffle=self.shuffle, seed=self.seed, epoch=pass_,
                shuffle_window=self.shuffle_window, stream=(_MIX_SALT, source))
        return found

    def split(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample id in it) of global ids."""
        ids = np.asarray(ids, dtype=np.int64)
        sources = np.searchsorted(self.offsets, ids, side="right") - 1
        return sources, ids - self.offsets[sources]

    def __repr__(self) -> str:
        return (f"MixOrder(sizes={self.sizes}, counts={self.counts}, shuffle={self.shuffle}, seed={self.seed}, "
                f"epoch={self.epoch}, shuffle_window={self.shuffle_window})")
