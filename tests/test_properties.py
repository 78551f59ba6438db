"""Properties of the epoch plan for any sizes (hypothesis): the order is a bijection, the
ranks' shares partition it, a mixture draws each source as often as asked, generations of
any world size hand out every position once (`Remaining`), and a resumed epoch (same or
another world and batch size) delivers every sample exactly once."""
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dmdask.client.resume import resume_point
from dmdask.plan.elastic import remaining
from dmdask.plan.mix import MixOrder
from dmdask.plan.order import ORDER_VERSION, EpochOrder, RankShare

settings.register_profile("dmdask", max_examples=60, deadline=None)
settings.load_profile("dmdask")

orders = st.builds(lambda n, block_len, window, shuffle, seed, epoch: EpochOrder(
    n, block_len, shuffle=shuffle, seed=seed, epoch=epoch, shuffle_window=window),
    st.integers(0, 3000), st.integers(1, 200), st.none() | st.integers(1, 40), st.booleans(),
    st.integers(0, 2**32), st.integers(0, 1000))


def _share_ids(share):
    return np.concatenate([share.batch(i) for i in range(len(share))] + [np.zeros(0, np.int64)])


@given(orders)
def test_the_order_is_a_bijection_and_positions_inverts_it(order):
    ids = order.ids(np.arange(order.num_samples))
    assert ids.dtype == np.int64 and np.array_equal(np.sort(ids), np.arange(order.num_samples))
    assert np.array_equal(order.positions(ids), np.arange(order.num_samples))
    some = np.random.default_rng(order.seed).permutation(order.num_samples)[:100]  # as a rank's batches ask
    assert np.array_equal(order.ids(some), ids[some]) and np.array_equal(order.positions(ids[some]), some)
    if not order.shuffle:
        assert np.array_equal(ids, np.arange(order.num_samples))


@given(orders)
def test_a_reader_of_a_windowed_order_needs_at_most_window_blocks_at_a_time(order):
    if not order.shuffle or order.shuffle_window is None:
        return
    blocks = order.ids(np.arange(order.num_samples)) // order.block_len
    left = np.bincount(blocks, minlength=order.num_blocks)  # samples of each block not yet read
    open_blocks = set()
    for b in blocks.tolist():
        open_blocks.add(b)
        left[b] -= 1
        assert len(open_blocks) <= order.shuffle_window
        if not left[b]:
            open_blocks.discard(b)


@given(orders, st.integers(1, 8), st.integers(1, 64), st.booleans())
def test_the_ranks_shares_partition_the_epoch(order, world, batch, drop_last):
    shares = [RankShare(order, r, world, batch, drop_last) for r in range(world)]
    ids, full = np.concatenate([_share_ids(s) for s in shares]), order.ids(np.arange(order.num_samples))
    assert len(np.unique(ids)) == len(ids)
    per_rank = order.num_samples // (world * batch) * batch if drop_last else None
    for rank, share in enumerate(shares):  # dealt by interleaving, whatever the number of ranks
        assert np.array_equal(_share_ids(share), full[rank::world][:per_rank])
    if drop_last:
        assert {s.num_samples for s in shares} == {per_rank}
        assert all(len(s.batch(i)) == batch for s in shares for i in range(len(s)))
    else:
        assert np.array_equal(np.sort(ids), np.arange(order.num_samples))


@given(orders, st.lists(st.tuples(st.integers(1, 6), st.integers(1, 16)), min_size=1, max_size=4), st.booleans(),
       st.data())
def test_generations_of_any_world_size_hand_out_every_position_once(order, generations, drop_last, data):
    """Each generation's ranks stop anywhere (the last one's run to the end) and the next
    deals what `Remaining` leaves: every sample comes at most once, all of them without
    drop_last (with it, all but under world * batch of the last generation's), and the
    positions `Remaining` keeps explicitly are at most the ranks' skews, not the epoch."""
    history, delivered, skew = [], [], 0
    for g, (world, batch) in enumerate(generations):
        shares = [RankShare(order, r, world, batch, drop_last, remaining(order.num_samples, history))
                  for r in range(world)]
        stops = [len(s) if g == len(generations) - 1 else data.draw(st.integers(0, len(s))) for s in shares]
        delivered += [b for s, p in zip(shares, stops) for b in s.batches(0, p)]
        consumed = [min(p * batch, s.num_samples) for s, p in zip(shares, stops)]
        history.append({"world_size": world, "consumed": consumed})
        skew += world * (max(consumed) - min(consumed))
        assert len(remaining(order.num_samples, history).head) <= skew
    ids = np.concatenate(delivered + [np.zeros(0, np.int64)])
    assert len(np.unique(ids)) == len(ids)
    if drop_last:
        assert len(ids) > order.num_samples - world * batch
    else:
        assert np.array_equal(np.sort(ids), np.arange(order.num_samples))


@given(st.lists(st.tuples(st.integers(1, 500), st.integers(0, 900), st.integers(1, 64)), min_size=1, max_size=4),
       st.booleans(), st.integers(0, 2**32), st.integers(0, 50), st.none() | st.integers(1, 8))
def test_a_mixture_draws_each_source_as_often_as_asked(sources, shuffle, seed, epoch, window):
    sizes, counts, block_lens = map(list, zip(*sources))
    mix = MixOrder(sizes, counts, block_lens, shuffle=shuffle, seed=seed, epoch=epoch, shuffle_window=window)
    ids = mix.ids(np.arange(mix.num_samples))
    drawn = np.searchsorted(mix.offsets, ids, side="right") - 1
    assert np.bincount(drawn, minlength=len(sizes)).tolist() == counts
    for s, size in enumerate(sizes):
        mine = ids[drawn == s] - mix.offsets[s]
        assert mine.min(initial=0) >= 0 and mine.max(initial=0) < size


@given(orders, st.integers(1, 6), st.integers(1, 32), st.integers(1, 6), st.integers(1, 32), st.data())
def test_a_resumed_epoch_delivers_every_sample_once(order, world, batch, new_world, new_batch, data):
    """Ranks of (world, batch) stop at any batch; the run resumes with (new_world, new_batch)."""
    def share(rank, world_size, batch_size, history):
        return RankShare(order, rank, world_size, batch_size, False,
                         remaining(order.num_samples, history) if history else None)

    common = {"order": ORDER_VERSION, "identity": "ds", "epoch": order.epoch, "seed": order.seed,
              "shuffle": order.shuffle, "shuffle_window": order.shuffle_window, "drop_last": False, "history": []}
    old = [share(r, world, batch, []) for r in range(world)]
    stops = [data.draw(st.integers(0, len(s)), label=f"rank {r} stops at") for r, s in enumerate(old)]
    states = [dict(common, rank=r, world_size=world, batch_size=batch, position=p) for r, p in enumerate(stops)]
    delivered = [s.batches(0, p) for s, p in zip(old, stops)]
    for rank in range(new_world):
        spec = SimpleNamespace(rank=rank, world_size=new_world, batch_size=new_batch)
        current = dict(common, rank=rank, world_size=new_world, batch_size=new_batch, position=0)
        history, position = resume_point(states, spec, current, share)
        mine = share(rank, new_world, new_batch, history)
        delivered.append(mine.batches(position, len(mine)))
    ids = np.concatenate([b for batches in delivered for b in batches] + [np.zeros(0, np.int64)])
    assert np.array_equal(np.sort(ids), np.arange(order.num_samples))
