"""The epoch order and the ranks' shares: pure functions, checked exhaustively."""
import numpy as np
import pytest

from dmdask.order import epoch_order, rank_batches


def bounds_for(n, block):
    return np.array(list(range(0, n, block)) + [n], dtype=np.int64)


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("world,batch", [(1, 7), (3, 10), (4, 64), (5, 1)])
def test_ranks_partition_the_epoch_exactly_once(window, world, batch):
    n = 1003  # divisible by neither the block (64) nor the batch size
    order = epoch_order(bounds_for(n, 64), epoch=2, shuffle=True, seed=5, shuffle_window=window)
    assert sorted(order.tolist()) == list(range(n))
    shares = [rank_batches(order, r, world, batch, drop_last=False) for r in range(world)]
    ids = np.concatenate([b for s in shares for b in s])
    assert len(ids) == n and set(ids.tolist()) == set(range(n))
    counts = [len(s) for s in shares]
    assert max(counts) - min(counts) <= 1
    assert all(len(b) == batch for s in shares for b in s[:-1])


@pytest.mark.parametrize("world,batch", [(3, 10), (4, 64), (2, 501)])
def test_drop_last_gives_every_rank_the_same_full_batches(world, batch):
    n = 1003
    order = epoch_order(bounds_for(n, 64), 0, True, 0, None)
    shares = [rank_batches(order, r, world, batch, drop_last=True) for r in range(world)]
    assert len({len(s) for s in shares}) == 1
    assert all(len(b) == batch for s in shares for b in s)
    ids = np.concatenate([b for s in shares for b in s])
    assert len(np.unique(ids)) == len(ids) == len(shares[0]) * batch * world
    assert len(ids) > n - world * batch


def test_same_seed_and_epoch_same_order_other_epochs_differ():
    b = bounds_for(1000, 100)
    a0 = epoch_order(b, 0, True, 1, None)
    assert np.array_equal(a0, epoch_order(b, 0, True, 1, None))
    assert not np.array_equal(a0, epoch_order(b, 1, True, 1, None))
    assert not np.array_equal(a0, epoch_order(b, 0, True, 2, None))
    assert np.array_equal(epoch_order(b, 3, False, 1, None), np.arange(1000))


def test_shuffle_window_keeps_each_window_within_its_blocks():
    b = bounds_for(1000, 100)
    order = epoch_order(b, 4, True, 9, shuffle_window=2)
    for w in range(5):
        window = order[w * 200:(w + 1) * 200]
        blocks = set((window // 100).tolist())
        assert len(blocks) == 2
    assert sorted(order.tolist()) == list(range(1000))
    # samples are mixed inside a window, not left in block order
    assert not np.array_equal(np.sort(order[:200]), order[:200])
