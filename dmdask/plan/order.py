"""The order of an epoch and each rank's share of it, computed per position.

Guarantees:

- `EpochOrder` is a bijection from positions 0..n-1 to sample ids 0..n-1 that depends only
  on (num_samples, block_len, shuffle, seed, epoch, shuffle_window): never on the cluster,
  the cache or the number of ranks. The same arguments give the same order on any machine
  (fixed-width integer arithmetic; keys from numpy's `SeedSequence`); other epochs or seeds
  give other orders.
- The id at any position, and the position of any id, cost O(1) time and memory: nothing
  is ever materialised over all samples.
- The ranks' shares (`RankShare`) partition the epoch: every sample goes to exactly one
  rank (with `drop_last=True`, the tail that does not fill a batch on every rank goes to
  none).

How: a balanced Feistel network over the smallest power of 4 >= n, keyed by (seed, epoch),
with cycle-walking to stay inside range(n). With `shuffle_window=k` the blocks are permuted
by a network of their own, the permuted block sequence is cut into windows of k blocks, and
the samples of each window are permuted among themselves by a network tweaked by the window
index.
"""
from __future__ import annotations

import operator
from typing import List, Optional, Sequence

import numpy as np
import numpy.ma  # noqa: F401 - numpy imports it lazily, on the first np.unique: a rank's first batch (7-25 ms)
import numpy.random  # noqa: F401 - numpy imports it lazily, on the first epoch's order (12 ms)

ORDER_VERSION = 2  # the order's algorithm; a resume state records it (1: dmdask 0.1's materialised permutation)
ROUNDS = 6  # Feistel rounds; 4 already make a strong pseudo-random permutation (Luby-Rackoff)
_ORDER_SALT = 0x6F72646572  # "order": keys of the whole-epoch permutation
_BLOCK_SALT = 0x626C6F636B  # "block": keys of the block permutation (window mode)
_WINDOW_SALT = 0x77696E646F  # "windo": keys of the in-window permutations
_CHUNK = 1 << 16  # positions evaluated at a time by blocks_first_needed
CHUNK_SAMPLES = 1 << 13  # a rank's ids computed at a time (64 KiB: see _SLICE)
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


def _through_table(function, values: np.ndarray) -> np.ndarray:
    """function(values) for int64 values, evaluated once per distinct value when they span fewer
    values than there are (the slots or windows of a batch), else once per value."""
    if len(values) == 0:
        return function(values)
    low, high = int(values.min()), int(values.max())
    if high - low + 1 >= len(values):
        return function(values)
    return function(np.arange(low, high + 1, dtype=np.int64))[values - low]


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
        return self._cycle_walk(self._encrypt, values, tweak)

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

    def _encrypt(self, values, tweak):
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


class _Windows:
    """The window mode: position <-> (window, offset) <-> sample id, O(1) per value.

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


def check_int(name: str, value, low: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class EpochOrder:
    """The order of one epoch: a bijection from positions 0..n-1 to sample ids 0..n-1.

    shuffle=False is the stored order (id == position), whatever the window. shuffle=True
    with shuffle_window=None is a keyed pseudo-random permutation of all samples. With
    shuffle_window=k the blocks (block b = samples b*block_len .. min(n, (b+1)*block_len) - 1)
    are shuffled and cut into windows of k consecutive blocks, and each window's samples are
    shuffled among themselves: a window's positions cover exactly the samples of its blocks,
    so a reader needs only k blocks at a time. k >= num_blocks is one window over all.

    stream: further integers that select an unrelated order for the same (seed, epoch),
    such as a source of a mixture and its pass (`dmdask.plan.mix`); () is the order of a
    dataset read alone.
    """

    def __init__(self, num_samples: int, block_len: int, *, shuffle: bool, seed: int, epoch: int,
                 shuffle_window: Optional[int] = None, stream: Sequence[int] = ()):
        self.num_samples = check_int("num_samples", num_samples, 0)
        if self.num_samples >= 2**62:  # positions and ids are int64, with room for arithmetic
            raise ValueError(f"num_samples must be below 2**62, got {num_samples!r}")
        self.block_len = check_int("block_len", block_len, 1)
        self.seed = check_int("seed", seed, 0)
        self.epoch = check_int("epoch", epoch, 0)
        if shuffle_window is not None:
            shuffle_window = check_int("shuffle_window", shuffle_window, 1)
        self.shuffle = bool(shuffle)
        self.shuffle_window = shuffle_window
        self.stream = tuple(check_int("stream", v, 0) for v in stream)
        self.num_blocks = -(-self.num_samples // self.block_len)
        self._whole: Optional[Feistel] = None
        self._windows: Optional[_Windows] = None
        if self.shuffle and shuffle_window is None:
            self._whole = Feistel(self.num_samples, round_keys(self.seed, self.epoch, _ORDER_SALT, ROUNDS,
                                                                 self.stream))
        elif self.shuffle and self.num_samples:
            self._windows = _Windows(self.num_samples, self.block_len, shuffle_window, self.seed, self.epoch,
                                     self.stream)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """int64 sample ids at the given positions (any int array), O(len(positions)) time and memory.

        The result has the shape of `positions`. IndexError if a position is outside 0..n-1.
        """
        flat, shape = self._checked(positions, "position")
        if self._whole is not None:
            out = self._whole.forward(flat.astype(np.uint64)).astype(np.int64)
        elif self._windows is not None:
            out = self._windows.ids(flat)
        else:
            out = flat.copy()
        return out.reshape(shape)

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The inverse of `ids`: int64 positions of the given sample ids, positions(ids(p)) == p."""
        flat, shape = self._checked(ids, "sample id")
        if self._whole is not None:
            out = self._whole.backward(flat.astype(np.uint64)).astype(np.int64)
        elif self._windows is not None:
            out = self._windows.positions(flat)
        else:
            out = flat.copy()
        return out.reshape(shape)

    def blocks_first_needed(self, limit: int) -> np.ndarray:
        """Block indices (block k = samples k*block_len .. min(n,(k+1)*block_len)-1) ordered by the first
        position that touches them, judged from the first `limit` positions only (evaluated in chunks,
        stopping early once every block was seen); blocks not seen follow in index order. Every block
        appears exactly once. O(limit + num_blocks)."""
        limit = min(check_int("limit", limit, 0), self.num_samples)
        if not self.shuffle:  # position order is block order
            return np.arange(self.num_blocks, dtype=np.int64)
        seen = np.zeros(self.num_blocks, dtype=bool)
        found: List[np.ndarray] = []
        num_seen = 0
        for start in range(0, limit, _CHUNK):
            if num_seen == self.num_blocks:
                break
            blocks = self.ids(np.arange(start, min(limit, start + _CHUNK), dtype=np.int64)) // self.block_len
            unique, first_index = np.unique(blocks, return_index=True)
            new = ~seen[unique]
            unique, first_index = unique[new], first_index[new]
            found.append(unique[np.argsort(first_index)])
            seen[unique] = True
            num_seen += len(unique)
        found.append(np.flatnonzero(~seen))
        return np.concatenate(found).astype(np.int64)

    def _checked(self, values, what: str):
        array = np.asarray(values)
        if array.size == 0:
            return np.zeros(0, dtype=np.int64), array.shape
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{what}s must be integers, got an array of {array.dtype}")
        low, high = array.min(), array.max()
        if low < 0 or high >= self.num_samples:
            bad = low if low < 0 else high
            raise IndexError(f"{what} {bad} is outside 0..{self.num_samples - 1}")
        return array.astype(np.int64, copy=False).ravel(), array.shape

    def __repr__(self) -> str:
        return (f"EpochOrder(num_samples={self.num_samples}, block_len={self.block_len}, shuffle={self.shuffle}, "
                f"seed={self.seed}, epoch={self.epoch}, shuffle_window={self.shuffle_window}"
                + (f", stream={self.stream}" if self.stream else "") + ")")


class RankShare:
    """One rank's share of an epoch: positions rank, rank + world_size, rank + 2*world_size, ... cut into batches.

    `remaining` (a `dmdask.plan.elastic.Remaining`): deal only the positions earlier
    generations of ranks left (elastic resume); the same rules apply to its length.

    Interleaving keeps all ranks at the same point of the epoch. With drop_last=True every
    rank gets (n // (world_size*batch_size)) * batch_size samples in full batches and the
    tail goes to no one; with drop_last=False the last batch may be short and, over all
    ranks, every sample is delivered exactly once. Batches are computed on demand.
    """

    def __init__(self, order: EpochOrder, rank: int, world_size: int, batch_size: int, drop_last: bool,
                 remaining=None):
        self.order = order
        # the positions dealt: all of the epoch's, or what earlier generations left (elastic resume)
        self.remaining = remaining
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be below world_size={self.world_size}, got {rank!r}")
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.drop_last = bool(drop_last)
        n = order.num_samples if remaining is None else len(remaining)
        if self.drop_last:
            self.num_samples = (n // (self.world_size * self.batch_size)) * self.batch_size
        else:
            self.num_samples = len(range(self.rank, n, self.world_size))
        self._num_batches = -(-self.num_samples // self.batch_size)
        self._chunk = (0, np.zeros(0, dtype=np.int64))  # (first sample of the share, ids from there)

    def __len__(self) -> int:
        """The number of batches of this rank."""
        return self._num_batches

    def batch(self, i: int) -> np.ndarray:
        """int64 sample ids of batch i (0 <= i < len(self)); IndexError otherwise."""
        i = operator.index(i)
        if not 0 <= i < self._num_batches:
            raise IndexError(f"batch {i!r} is outside 0..{self._num_batches - 1}")
        return self.batches(i, i + 1)[0]

    def batches(self, start: int, stop: int) -> List[np.ndarray]:
        """Batches start..stop-1 (0 <= start <= stop <= len(self)), computed together; IndexError otherwise."""
        start, stop = operator.index(start), operator.index(stop)
        if not 0 <= start <= stop <= self._num_batches:
            raise IndexError(f"batches {start!r}..{stop!r} are outside 0..{self._num_batches}")
        first, end = start * self.batch_size, min(self.num_samples, stop * self.batch_size)
        ids = self._ids(first, end)
        return [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]

    def _ids(self, first: int, end: int) -> np.ndarray:
        """Ids of share samples first..end-1, computed in chunks: a call on a few batches
        costs a fixed ~0.1 ms per cycle-walking pass, a chunk amortises it. Chunks double
        from the size asked up to CHUNK_SAMPLES, so the first batch waits for its own ids only."""
        at, ids = self._chunk
        if not (at <= first and end <= at + len(ids)):
            size = min(CHUNK_SAMPLES, max(end - first, 2 * len(ids)))
            stop = min(self.num_samples, max(end, first + size))
            positions = self.rank + self.world_size * np.arange(first, stop, dtype=np.int64)
            if self.remaining is not None:
                positions = self.remaining.at(positions)
            ids = self.order.ids(positions)
            at, self._chunk = first, (first, ids)
        return ids[first - at:end - at]
