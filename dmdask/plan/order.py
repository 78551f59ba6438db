"""The order of an epoch and each rank's share of it, computed per position.

Guarantees:

- `EpochOrder` is a bijection from positions 0..n-1 to sample ids 0..n-1 that depends only
  on (num_samples, block_len, shuffle, seed, epoch, shuffle_window): never on the cluster,
  the cache or the number of ranks. The same arguments give the same order on any machine;
  other epochs or seeds give other orders.
- The id at any position, and the position of any id, cost O(1) time and memory.
- The ranks' shares (`RankShare`) partition the epoch: every sample goes to exactly one
  rank (with `drop_last=True`, the tail that does not fill a batch on every rank goes to
  none).
"""
from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import numpy.ma  # noqa: F401 - now, not lazily at the first np.unique (a rank's first batch)

from .feistel import ROUNDS, Feistel, round_keys
from .windows import Windows

ORDER_VERSION = 4  # the order's algorithm; a resume state records it (1: dmdask 0.1's materialised permutation;
# 2: a balanced Feistel network over a power of 4; 3: rounds hashed by splitmix64)
_ORDER_SALT = 0x6F72646572  # "order": keys of the whole-epoch permutation
_CHUNK = 1 << 16  # positions evaluated at a time by blocks_first_needed
CHUNK_SAMPLES = 1 << 13  # a rank's ids computed at a time (64 KiB: see feistel._SLICE)


def check_int(name: str, value, low: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_positions(values, num_samples: int, what: str = "position") -> tuple[np.ndarray, tuple]:
    """(`values` as a flat int64 array, their shape); ValueError unless integers,
    IndexError if one is outside 0..num_samples-1."""
    array = np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64), array.shape
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what}s must be integers, got an array of {array.dtype}")
    low, high = array.min(), array.max()
    if low < 0 or high >= num_samples:
        bad = low if low < 0 else high
        raise IndexError(f"{what} {bad} is outside 0..{num_samples - 1}")
    return array.astype(np.int64, copy=False).ravel(), array.shape


class EpochOrder:
    """The order of one epoch (see the module's guarantees).

    shuffle=False is the stored order (id == position), whatever the window. shuffle=True
    with shuffle_window=None is a keyed `Feistel` permutation of all samples. With
    shuffle_window=k (`Windows`) a window's positions cover exactly the samples of k
    blocks (block b = samples b*block_len ..), so a reader needs only k blocks at a time.

    stream: further integers that select an unrelated order for the same (seed, epoch),
    such as a source of a mixture and its pass (`dmdask.plan.mix`); () is the order of a
    dataset read alone.
    """

    def __init__(self, num_samples: int, block_len: int, *, shuffle: bool, seed: int, epoch: int,
                 shuffle_window: int | None = None, stream: Sequence[int] = ()):
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
        self._whole: Feistel | None = None
        self._windows: Windows | None = None
        if self.shuffle and shuffle_window is None:
            self._whole = Feistel(self.num_samples, round_keys(self.seed, self.epoch, _ORDER_SALT, ROUNDS,
                                                                 self.stream))
        elif self.shuffle and self.num_samples:
            self._windows = Windows(self.num_samples, self.block_len, shuffle_window, self.seed, self.epoch,
                                     self.stream)

    @classmethod
    def of(cls, info, spec, epoch: int) -> "EpochOrder":
        """`spec`'s order (shuffle, seed, shuffle_window) of `epoch` over the dataset `info`
        (a `DatasetInfo`: its samples and block length)."""
        return cls(info.num_samples, info.block_len, shuffle=spec.shuffle, seed=spec.seed, epoch=epoch,
                   shuffle_window=spec.shuffle_window)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """int64 sample ids at `positions` (any int array, whose shape the result has);
        IndexError if a position is outside 0..n-1."""
        flat, shape = check_positions(positions, self.num_samples)
        if self._whole is not None:
            out = self._whole.forward(flat.astype(np.uint64)).astype(np.int64)
        elif self._windows is not None:
            out = self._windows.ids(flat)
        else:
            out = flat.copy()
        return out.reshape(shape)

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The inverse of `ids`: int64 positions of the given sample ids, positions(ids(p)) == p."""
        flat, shape = check_positions(ids, self.num_samples, "sample id")
        if self._whole is not None:
            out = self._whole.backward(flat.astype(np.uint64)).astype(np.int64)
        elif self._windows is not None:
            out = self._windows.positions(flat)
        else:
            out = flat.copy()
        return out.reshape(shape)

    def blocks_first_needed(self, limit: int, blocks_of=None, num_blocks: int | None = None) -> np.ndarray:
        """Block indices ordered by the first position that touches them, judged from the first
        `limit` positions only; blocks not seen follow in index order. Every block appears
        exactly once. O(limit + num_blocks). blocks_of(ids): the blocks each id touches, an
        int64 array (n, k) or (n,), in ids' order, rising with the ids (default: ids //
        block_len); num_blocks: how many there are (default: this order's); given both, the
        ids may be of windows (`window_order`) and the blocks of their rows."""
        limit = min(check_int("limit", limit, 0), self.num_samples)
        num_blocks = self.num_blocks if num_blocks is None else num_blocks
        if not self.shuffle:  # position order is block order
            return np.arange(num_blocks, dtype=np.int64)
        blocks_of = blocks_of or (lambda ids: ids // self.block_len)
        seen = np.zeros(num_blocks, dtype=bool)
        found: list[np.ndarray] = []
        num_seen = 0
        for start in range(0, limit, _CHUNK):
            if num_seen == num_blocks:
                break
            blocks = blocks_of(self.ids(np.arange(start, min(limit, start + _CHUNK), dtype=np.int64))).ravel()
            unique, first_index = np.unique(blocks, return_index=True)
            new = ~seen[unique]
            unique, first_index = unique[new], first_index[new]
            found.append(unique[np.argsort(first_index)])
            seen[unique] = True
            num_seen += len(unique)
        found.append(np.flatnonzero(~seen))
        return np.concatenate(found).astype(np.int64)

    def __repr__(self) -> str:
        return (f"EpochOrder(num_samples={self.num_samples}, block_len={self.block_len}, shuffle={self.shuffle}, "
                f"seed={self.seed}, epoch={self.epoch}, shuffle_window={self.shuffle_window}"
                + (f", stream={self.stream}" if self.stream else "") + ")")


class RankShare:
    """One rank's share of an epoch: positions rank, rank + world_size, rank + 2*world_size, ... cut into batches.

    `remaining` (a `dmdask.plan.elastic.Remaining`): deal only the positions earlier
    generations of ranks left (elastic resume). With drop_last=True every rank gets
    (n // (world_size*batch_size)) * batch_size samples in full batches; with
    drop_last=False the last batch may be short. Batches are computed on demand.
    """

    def __init__(self, order: EpochOrder, rank: int, world_size: int, batch_size: int, drop_last: bool,
                 remaining=None):
        self.order = order
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

    def batches(self, start: int, stop: int) -> list[np.ndarray]:
        """Batches start..stop-1 (0 <= start <= stop <= len(self)), computed together; IndexError otherwise."""
        start, stop = operator.index(start), operator.index(stop)
        if not 0 <= start <= stop <= self._num_batches:
            raise IndexError(f"batches {start!r}..{stop!r} are outside 0..{self._num_batches}")
        first, end = start * self.batch_size, min(self.num_samples, stop * self.batch_size)
        ids = self._ids(first, end)
        return [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]

    def _ids(self, first: int, end: int) -> np.ndarray:
        """Ids of share samples first..end-1, computed in chunks that double from the size
        asked up to CHUNK_SAMPLES, so the first batch waits for its own ids only."""
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


def window_order(info, spec, epoch: int) -> EpochOrder:
    """The order of `spec.window`'s windows over the rows of `info` in `epoch` (the order
    `BatchIterator` hands them out in): `spec.window.count(info.num_samples)` window ids."""
    return EpochOrder(spec.window.count(info.num_samples), max(1, info.block_len // spec.window.stride),
                      shuffle=spec.shuffle, seed=spec.seed, epoch=epoch)


def load_order(info, spec, epoch: int, limit: int) -> np.ndarray:
    """The blocks of `info` in the order `spec`'s epoch first needs them, judged from its first
    `limit` positions (`EpochOrder.blocks_first_needed`): of its samples, or with a
    `spec.window`, of its windows, each needing the blocks of its rows."""
    if spec.window is None:
        return EpochOrder.of(info, spec, epoch).blocks_first_needed(limit)
    window, block_len = spec.window, info.block_len
    span = (window.length - 1) // block_len + 2  # the most blocks one window's rows touch

    def blocks_of(windows):
        first = windows * window.stride // block_len
        last = (windows * window.stride + window.length - 1) // block_len
        return np.minimum(first[:, None] + np.arange(span, dtype=np.int64), last[:, None])

    return window_order(info, spec, epoch).blocks_first_needed(limit, blocks_of, info.num_blocks)


class WindowShare:
    """A rank's share of an epoch of windows (`dmdask.Window`): `share` (a `RankShare` over
    window ids) whose batches are the rows of its windows, window after window (`starts_of(window
    ids)`: the first row of each, a mixture's own, else the window's `starts`), so that the
    fetch path reads rows; the same-host path reads whole windows (`windows`, `starts_of`).
    The ranks' shares partition the windows as `RankShare` partitions samples."""

    def __init__(self, share: RankShare, window, starts_of=None):
        self.share, self.window = share, window
        self.starts_of = starts_of or window.starts

    @property
    def order(self) -> EpochOrder:
        return self.share.order

    @property
    def num_samples(self) -> int:
        """The windows of this rank."""
        return self.share.num_samples

    def __len__(self) -> int:
        return len(self.share)

    def batches(self, start: int, stop: int) -> list[np.ndarray]:
        """The row ids of batches start..stop-1 (`RankShare.batches`)."""
        return [self.window.rows_from(self.starts_of(ids)) for ids in self.share.batches(start, stop)]

    def windows(self, start: int, stop: int) -> list[np.ndarray]:
        """The window ids of batches start..stop-1 (`RankShare.batches`), not expanded to rows."""
        return self.share.batches(start, stop)
