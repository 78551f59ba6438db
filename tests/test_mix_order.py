"""The order of a mixture epoch (dmdask.plan.mix): exact counts, passes, spread, determinism."""
import numpy as np
import pytest

from dmdask.plan.elastic import remaining
from dmdask.plan.mix import MIX_ROUND, MixOrder, apportion
from dmdask.plan.order import RankShare


def mix(sizes, counts, shuffle=True, seed=3, epoch=0, window=None, block_lens=None):
    return MixOrder(sizes, counts, block_lens or [7] * len(sizes), shuffle=shuffle, seed=seed, epoch=epoch,
                    shuffle_window=window)


def all_draws(order):
    return order.draws(np.arange(order.num_samples))


# -- apportion -----------------------------------------------------------------------------------

def test_apportion_gives_exact_quotas_and_the_rest_by_largest_remainder():
    assert apportion(1100, [1, 1]) == [550, 550]
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]  # ties: the first
    assert apportion(1003, [1003, 0]) == [1003, 0]
    assert apportion(350, [300, 50]) == [300, 50]  # weights = sizes: every quota is whole
    assert apportion(7, [0.7, 0.3]) == [5, 2]
    assert apportion(100, [0.1, 0.2, 0.7]) == [10, 20, 70]  # exact despite binary floats
    assert apportion(0, [1, 2]) == [0, 0]
    rng = np.random.default_rng(0)
    for _ in range(200):
        weights = rng.random(int(rng.integers(1, 6))) * (rng.random() < 0.8)
        weights[0] += 0.01
        total = int(rng.integers(0, 10_000))
        counts = apportion(total, weights.tolist())
        assert sum(counts) == total
        quotas = total * weights / weights.sum()
        assert all(abs(c - q) < 1 for c, q in zip(counts, quotas))
    for bad in ([], [-1, 2], [0, 0]):
        with pytest.raises(ValueError, match="weights"):
            apportion(10, bad)


# -- positions -> draws ----------------------------------------------------------------------------

CASES = [([100, 37, 1000], [333, 667, 1000]), ([5], [12]), ([10, 10], [1, 0]), ([3, 4, 5, 6, 7, 8, 9], [1] * 7),
         ([1000, 20], [64, 64]), ([50, 60, 70], [0, 3001, 2]), ([1, 1], [4000, 1]), ([9] * 40, [17] * 40)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("sizes,counts", CASES)
def test_every_draw_of_the_epoch_is_at_exactly_one_position(sizes, counts, shuffle):
    order = mix(sizes, counts, shuffle=shuffle, epoch=2)
    assert order.num_samples == sum(counts)
    sources, ks = all_draws(order)
    assert sources.dtype == ks.dtype == np.int64
    for source, count in enumerate(counts):
        assert np.array_equal(np.sort(ks[sources == source]), np.arange(count))
    ids = order.ids(np.arange(order.num_samples))
    split_sources, in_source = order.split(ids)
    assert np.array_equal(split_sources, sources)
    assert ((0 <= in_source) & (in_source < np.array(sizes)[sources])).all()
    some = np.random.default_rng(1).permutation(order.num_samples)[:200]  # scattered, as a rank asks
    assert np.array_equal(order.ids(some), ids[some])


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_source_is_read_in_passes_without_repeats_across_epochs(shuffle, window):
    """Source draws numbered on over epochs: every run of n consecutive draws of a source
    is a permutation of its samples, whether it is drawn more or less than its size."""
    sizes, counts = [100, 37, 1000], [333, 667, 1000]  # under, over and once per epoch
    drawn = {s: [] for s in range(3)}
    for epoch in range(4):
        order = mix(sizes, counts, shuffle=shuffle, epoch=epoch, window=window, block_lens=[10, 4, 64])
        sources, ks = all_draws(order)
        ids = order.split(order.ids(np.arange(order.num_samples)))[1]
        for s in range(3):
            mine = sources == s
            drawn[s].append(ids[mine][np.argsort(ks[mine])])  # in draw order
    for s, n in enumerate(sizes):
        sequence = np.concatenate(drawn[s])
        assert len(sequence) == 4 * counts[s]
        for start in range(0, len(sequence) - n + 1, n):
            assert np.array_equal(np.sort(sequence[start:start + n]), np.arange(n)), (s, start)
        passes = [sequence[i:i + n] for i in range(0, 2 * n, n)]
        if shuffle:  # each pass is its own permutation
            assert not np.array_equal(passes[0], passes[1])
        else:  # the stored order, pass after pass
            assert np.array_equal(sequence, np.arange(len(sequence)) % n)
    assert set(np.concatenate(drawn[2][:1]).tolist()) == set(range(1000))  # one pass an epoch


def test_the_weights_hold_in_every_stretch_of_the_epoch():
    """Rounds of about MIX_ROUND positions each hold their exact share of every source,
    so any stretch of positions is within a couple of rounds' draws of its share."""
    sizes, counts = [500, 300, 200], apportion(30_000, [5, 3, 2])
    order = mix(sizes, counts)
    sources, _ = all_draws(order)
    starts = order.draws_before(np.arange(order.num_rounds + 1))
    assert np.diff(starts.sum(axis=0)).max() < MIX_ROUND
    per_round = np.diff(starts, axis=1)  # each round holds each source's share to within one
    assert (np.abs(per_round - np.diff(starts.sum(axis=0)) * np.array(counts)[:, None] / sum(counts)) < 1.5).all()
    shares = np.array(counts) / sum(counts)
    for width in (64, 256, 1000):
        for start in range(0, order.num_samples - width, width):
            got = np.bincount(sources[start:start + width], minlength=3)
            slack = 2 * np.ceil(MIX_ROUND * shares) + 2  # two partial rounds at the ends
            assert (np.abs(got - width * shares) <= slack).all(), (width, start, got)


def test_positions_of_a_source_are_placed_at_random_within_rounds():
    order = mix([500, 500], [5000, 5000])
    sources, _ = all_draws(order)
    rounds = sources[:MIX_ROUND * 100].reshape(100, MIX_ROUND)
    assert len({r.tobytes() for r in rounds}) == 100  # no fixed pattern
    # where a round puts its source-0 positions: about uniform over the round
    column = np.tile(np.arange(MIX_ROUND), 100)[rounds.ravel() == 0]
    counts = np.bincount(column * 8 // MIX_ROUND, minlength=8)
    expected = len(column) / 8
    assert ((counts - expected) ** 2 / expected).sum() < 24.32  # chi-square, 7 dof, p = 0.001
    unshuffled = mix([500, 500], [5000, 5000], shuffle=False)
    starts = unshuffled.draws_before(np.arange(unshuffled.num_rounds + 1)).sum(axis=0)
    in_order = all_draws(unshuffled)[0]
    for start, stop in zip(starts[:-1], starts[1:]):  # sources take their turns in list order
        assert np.array_equal(in_order[start:stop], np.sort(in_order[start:stop]))


def test_a_source_with_a_shuffle_window_keeps_to_its_windows():
    """Draws of a source come in order from round to round: at any position, the draws
    already made are the first ones, less at most a round's worth."""
    order = mix([1000, 1000], [2000, 2000], window=2, block_lens=[10, 10])
    sources, ks = all_draws(order)
    for s in range(2):
        mine = ks[sources == s]
        behind = np.maximum.accumulate(mine) - mine
        assert behind.max() <= MIX_ROUND


def test_same_seed_and_epoch_same_order_others_differ():
    def ids(seed, epoch):
        return mix([100, 37], [300, 200], seed=seed, epoch=epoch).ids(np.arange(500))
    assert np.array_equal(ids(1, 0), ids(1, 0))
    assert not np.array_equal(ids(1, 0), ids(1, 1))
    assert not np.array_equal(ids(1, 0), ids(2, 0))


def test_the_mixture_order_is_pinned():
    """A saved position resumes only if the order stays the same: computed once."""
    order = mix([5, 3], [6, 4], seed=7, epoch=1, block_lens=[2, 2])
    assert order.ids(np.arange(10)).tolist() == PINNED


PINNED = [1, 5, 4, 6, 0, 1, 7, 0, 5, 3]  # order version 4


def test_huge_mixtures_cost_nothing_up_front():
    n = 10**15
    order = mix([n, 3], [n, 2 * n], window=4, block_lens=[4096, 1])
    positions = np.array([0, 1, n, 3 * n - 2, 3 * n - 1])
    ids = order.ids(positions)
    sources, in_source = order.split(ids)
    assert ((in_source >= 0) & (in_source < np.array([n, 3])[sources])).all()
    later = mix([n, 3], [n, 2 * n], epoch=10**6, block_lens=[4096, 1])
    assert later.ids(positions).shape == (5,)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_ranks_share_the_positions_of_a_mixture_exactly_once(world):
    order = mix([100, 37, 10], [120, 80, 51])
    full = order.ids(np.arange(order.num_samples))
    shares = [RankShare(order, r, world, 16, drop_last=False) for r in range(world)]
    for rank, share in enumerate(shares):
        got = np.concatenate([share.batch(i) for i in range(len(share))])
        assert np.array_equal(got, full[rank::world])
    # an elastic restart deals what is left of the same positions
    left = remaining(order.num_samples, [{"world_size": world, "consumed": [16] * world}])
    rest = [RankShare(order, r, 2, 16, False, left) for r in range(2)]
    again = np.concatenate([full[r::world][:16] for r in range(world)] +
                           [np.concatenate(s.batches(0, len(s))) for s in rest])
    assert np.array_equal(np.sort(again), np.sort(full))


def test_bad_arguments():
    with pytest.raises(ValueError, match="one length"):
        MixOrder([10, 10], [5], [1, 1], shuffle=True, seed=0, epoch=0)
    with pytest.raises(ValueError, match="size"):
        MixOrder([0, 10], [5, 5], [1, 1], shuffle=True, seed=0, epoch=0)
    with pytest.raises(IndexError, match="10"):
        mix([10, 10], [5, 5]).ids(np.array([10]))
    with pytest.raises(ValueError, match="float"):
        mix([10, 10], [5, 5]).ids(np.array([1.0]))
