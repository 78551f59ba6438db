"""The epoch order and the ranks' shares (dmdask.plan.order): pinned values, edge cases,
validation, statistics; that they are bijections and partitions for any sizes is in
test_properties.py."""
import numpy as np
import pytest

from dmdask.plan.order import EpochOrder, RankShare


def whole_order(order):
    return order.ids(np.arange(order.num_samples))


# -- bijection -----------------------------------------------------------------------------

def test_ids_keeps_the_shape_and_accepts_any_int_dtype():
    order = EpochOrder(100, 10, shuffle=True, seed=1, epoch=0)
    grid = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert order.ids(grid).shape == (3, 4)
    assert np.array_equal(order.ids(grid).ravel(), order.ids(np.arange(12, dtype=np.uint16)))
    assert order.ids(np.zeros(0, dtype=np.int64)).shape == (0,)


def test_huge_orders_cost_nothing_up_front():
    n = 10**15  # an array over all samples would not fit anywhere
    order = EpochOrder(n, 4096, shuffle=True, seed=3, epoch=1)
    positions = np.array([0, 1, n // 2, n - 1])
    ids = order.ids(positions)
    assert ids.min() >= 0 and ids.max() < n and len(set(ids.tolist())) == 4
    assert np.array_equal(order.positions(ids), positions)
    windowed = EpochOrder(n, 4096, shuffle=True, seed=3, epoch=1, shuffle_window=8)
    assert np.array_equal(windowed.positions(windowed.ids(positions)), positions)


# -- determinism -----------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 3])
def test_same_seed_and_epoch_same_order_other_seeds_or_epochs_differ(window):
    def ids(seed, epoch):
        return whole_order(EpochOrder(10007, 64, shuffle=True, seed=seed, epoch=epoch, shuffle_window=window))
    first = ids(1, 0)
    assert np.array_equal(first, ids(1, 0))
    assert not np.array_equal(first, ids(1, 1))
    assert not np.array_equal(first, ids(2, 0))


def test_the_order_is_pinned():
    """Resuming an epoch on another machine or release needs the very same order: these
    values were computed once; a change here breaks every saved position (order version 4:
    rounds hashed by multiply-add-shift; version 3 hashed them by splitmix64)."""
    order = EpochOrder(20, 4, shuffle=True, seed=7, epoch=3)
    assert whole_order(order).tolist() == [19, 5, 15, 17, 12, 13, 16, 14, 6, 4, 0, 9, 3, 10, 8, 11, 2, 1, 18, 7]
    windowed = EpochOrder(20, 4, shuffle=True, seed=7, epoch=3, shuffle_window=2)
    assert whole_order(windowed).tolist() == [14, 12, 13, 15, 6, 4, 5, 7, 9, 16, 11, 19, 8, 17, 10, 18,
                                              2, 3, 1, 0]
    huge = EpochOrder(10**12, 4, shuffle=True, seed=7, epoch=3)
    assert huge.ids(np.array([0, 1, 10**12 - 1])).tolist() == [721660483068, 815412295453, 200023323596]


# -- the ranks' shares -------------------------------------------------------------------------

def test_short_last_batch_and_batches_match_batch():
    order = EpochOrder(1003, 64, shuffle=True, seed=0, epoch=0)
    share = RankShare(order, 2, 3, 50, drop_last=False)
    assert share.num_samples == 334 and len(share) == 7
    assert [len(share.batch(i)) for i in range(7)] == [50] * 6 + [34]
    together = share.batches(2, 7)
    assert len(together) == 5
    assert all(np.array_equal(b, share.batch(2 + i)) for i, b in enumerate(together))
    assert share.batches(3, 3) == []


def test_batch_index_out_of_range_is_an_index_error():
    share = RankShare(EpochOrder(100, 10, shuffle=True, seed=0, epoch=0), 0, 2, 8, drop_last=True)
    assert len(share) == 6
    share.batch(5)
    for bad in (-1, 6, 100):
        with pytest.raises(IndexError):
            share.batch(bad)
    with pytest.raises(IndexError):
        share.batches(0, 7)
    with pytest.raises(IndexError):
        share.batches(4, 3)
    empty = RankShare(EpochOrder(10, 10, shuffle=True, seed=0, epoch=0), 0, 2, 8, drop_last=True)
    assert len(empty) == 0 and empty.num_samples == 0
    with pytest.raises(IndexError):
        empty.batch(0)


# -- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(num_samples=-1), "num_samples"), (dict(block_len=0), "block_len"), (dict(seed=-2), "seed"),
    (dict(epoch=1.5), "epoch"), (dict(shuffle_window=0), "shuffle_window"), (dict(epoch=True), "epoch"),
])
def test_bad_arguments_are_value_errors_naming_the_value(kwargs, name):
    args = dict(num_samples=100, block_len=10, shuffle=True, seed=0, epoch=0) | kwargs
    with pytest.raises(ValueError, match=name):
        EpochOrder(**args)


def test_bad_positions_and_ranks():
    order = EpochOrder(100, 10, shuffle=True, seed=0, epoch=0)
    with pytest.raises(IndexError, match="100"):
        order.ids(np.array([3, 100]))
    with pytest.raises(IndexError, match="-1"):
        order.positions(np.array([-1]))
    with pytest.raises(ValueError, match="float"):
        order.ids(np.array([1.0]))
    with pytest.raises(ValueError, match="rank"):
        RankShare(order, 4, 4, 1, drop_last=False)
    with pytest.raises(ValueError, match="batch_size"):
        RankShare(order, 0, 4, 0, drop_last=False)


# -- statistics (fixed seeds: deterministic, thresholds far from what a good shuffle gives) ------

def test_a_sample_lands_uniformly_over_the_positions():
    n, epochs, bins = 1000, 2000, 10
    samples = np.array([0, 1, 500, 998, 999])
    positions = np.array([EpochOrder(n, 100, shuffle=True, seed=42, epoch=e).positions(samples)
                          for e in range(epochs)])
    expected = epochs / bins
    for column in positions.T:
        counts = np.bincount(column * bins // n, minlength=bins)
        chi_square = ((counts - expected) ** 2 / expected).sum()
        # chi-square table, 9 degrees of freedom, p = 0.001: 27.877
        assert chi_square < 27.877, (counts, chi_square)


def test_ids_do_not_follow_the_positions():
    n = 100_000
    ids = whole_order(EpochOrder(n, 100, shuffle=True, seed=9, epoch=0))
    # ids and positions are both ranks 0..n-1, so Pearson's r is also Spearman's rho
    assert abs(np.corrcoef(np.arange(n), ids)[0, 1]) < 0.02
    gaps = np.diff(ids)
    assert np.count_nonzero(np.abs(gaps) == 1) < 20  # 2 expected by chance
    assert np.unique(gaps, return_counts=True)[1].max() < 20  # no rotation or stride


def test_inside_a_window_ids_do_not_follow_the_positions():
    n, window_len = 100_000, 1000  # windows of 10 blocks of 100
    ids = whole_order(EpochOrder(n, 100, shuffle=True, seed=9, epoch=0, shuffle_window=10))
    rank_in_window = np.argsort(np.argsort(ids.reshape(-1, window_len), axis=1), axis=1)
    offset_in_window = np.broadcast_to(np.arange(window_len), rank_in_window.shape)
    assert abs(np.corrcoef(offset_in_window.ravel(), rank_in_window.ravel())[0, 1]) < 0.02
    gaps = np.diff(rank_in_window, axis=1).ravel()
    chance = len(gaps) * 2 / window_len  # neighbours in a window of 1000: 2 in 1000
    assert np.count_nonzero(np.abs(gaps) == 1) < 2 * chance
    assert np.unique(gaps, return_counts=True)[1].max() < 2 * chance  # no rotation or stride


@pytest.mark.parametrize("window", [None, 10])
def test_ids_do_not_depend_on_how_many_are_asked_at_once(window):
    """Long requests are computed in slices (small temporaries): the same ids as one by one."""
    order = EpochOrder(100_000, 100, shuffle=True, seed=9, epoch=1, shuffle_window=window)
    positions = np.random.default_rng(0).permutation(100_000)
    at_once = order.ids(positions)
    assert np.array_equal(np.sort(at_once), np.arange(100_000))
    assert np.array_equal(at_once, np.concatenate([order.ids(p) for p in np.array_split(positions, 997)]))
    assert np.array_equal(order.positions(at_once), positions)


def test_consecutive_epochs_are_unrelated():
    n = 100_000
    orders = [whole_order(EpochOrder(n, 100, shuffle=True, seed=9, epoch=e)) for e in range(3)]
    for earlier, later in zip(orders, orders[1:]):
        assert abs(np.corrcoef(earlier, later)[0, 1]) < 0.02
        assert np.count_nonzero(earlier == later) < 20  # about 1 expected by chance
        # nor is the second epoch a fixed relabelling of the first
        gaps = np.argsort(later)[earlier] - np.arange(n)
        assert np.unique(gaps, return_counts=True)[1].max() < 20


# -- window mode --------------------------------------------------------------------------------

def window_blocks(order):
    """The blocks of each window, read off the order: blocks sorted by first position, k at a time."""
    blocks = whole_order(order) // order.block_len
    first = np.array([np.flatnonzero(blocks == b).min() for b in range(order.num_blocks)])
    by_first = np.argsort(first)
    k = order.shuffle_window
    return blocks, [by_first[i:i + k] for i in range(0, order.num_blocks, k)]


@pytest.mark.parametrize("n,block_len,k", [(1003, 64, 3), (1000, 100, 2), (10007, 7, 5), (65, 64, 1), (700, 7, 200)])
def test_each_window_covers_exactly_its_blocks(n, block_len, k):
    order = EpochOrder(n, block_len, shuffle=True, seed=3, epoch=5, shuffle_window=k)
    blocks, windows = window_blocks(order)
    start = 0
    for members in windows:
        size = sum(min(n, (b + 1) * block_len) - b * block_len for b in members)
        # the window's positions are the next `size` ones and hold all samples of its blocks
        assert set(blocks[start:start + size].tolist()) == set(members.tolist())
        start += size
    assert start == n
    if k > 1:  # samples of a window are mixed, not left block after block
        first_window = blocks[:len(windows[0]) * block_len]
        assert np.count_nonzero(np.diff(first_window)) > len(windows[0])


def test_windows_change_their_blocks_between_epochs():
    def blocks_of_windows(epoch):
        order = EpochOrder(1003, 64, shuffle=True, seed=3, epoch=epoch, shuffle_window=3)
        return [sorted(w.tolist()) for w in window_blocks(order)[1]]
    assert blocks_of_windows(0) != blocks_of_windows(1)


# -- blocks_first_needed -------------------------------------------------------------------------

def first_needed_brute_force(order, limit):
    blocks = whole_order(order)[:limit] // order.block_len
    unique, first = np.unique(blocks, return_index=True)
    seen = unique[np.argsort(first)]
    return np.concatenate([seen, np.setdiff1d(np.arange(order.num_blocks), seen)])


@pytest.mark.parametrize("n,block_len,window", [(10_000, 64, None), (10_000, 64, 3), (10_000, 1, None),
                                                (200_000, 1000, 1), (200_000, 1000, None), (0, 8, None)])
@pytest.mark.parametrize("limit", [0, 1, 300, 10**9])
def test_blocks_first_needed_matches_brute_force(n, block_len, window, limit):
    order = EpochOrder(n, block_len, shuffle=True, seed=8, epoch=2, shuffle_window=window)
    need = order.blocks_first_needed(limit=limit)
    assert need.dtype == np.int64
    assert np.array_equal(np.sort(need), np.arange(order.num_blocks))
    assert np.array_equal(need, first_needed_brute_force(order, limit))


def test_blocks_first_needed_in_stored_order_is_block_order():
    order = EpochOrder(1003, 64, shuffle=False, seed=8, epoch=2)
    assert np.array_equal(order.blocks_first_needed(limit=5), np.arange(16))
    with pytest.raises(ValueError, match="limit"):
        order.blocks_first_needed(limit=-1)
