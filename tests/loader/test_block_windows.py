"""Block order's windows as pure functions (``Blocked.window_of`` / ``window_shards``,
``Batches.shards_after``): what a worker stages ahead must be exactly the shards the next
window reads, on any rank and after a resume, and never change the order itself."""

import numpy as np

from stallfree.loader.order import Blocked, RankShare, Shuffled, batches, block_order


def _shard_of(sizes):
    return np.repeat(np.arange(len(sizes)), sizes)


def test_windows_are_the_shards_their_positions_read():
    sizes = (7, 0, 12, 5, 9, 11, 3, 8, 6, 10)
    order = Blocked(3, 1, sizes, window=3)
    shard_of = _shard_of(sizes)
    indices = order.at(np.arange(order.n))
    windows = order.window_of(np.arange(order.n))
    assert order.windows == 4 and set(np.unique(windows).tolist()) <= {0, 1, 2, 3}
    assert np.all(np.diff(windows) >= 0)  # windows are runs of positions
    for w in range(order.windows):
        read = set(shard_of[indices[windows == w]].tolist())
        named = set(order.window_shards(w).tolist())
        assert read == named - {1}  # shard 1 is empty: named, never read
    assert sorted(np.concatenate([order.window_shards(w) for w in range(4)]).tolist()) == list(range(10))


def test_window_helpers_leave_the_order_as_it_was():
    sizes = (5, 6, 7, 8, 9)
    before = block_order(11, 2, sizes, window=2)
    order = Blocked(11, 2, sizes, window=2)
    order.window_of([0, 5, 34])
    order.window_shards(1)
    assert np.array_equal(order.at(np.arange(order.n)), before)


def test_shards_after_names_the_next_window_on_every_rank_and_after_resume():
    sizes = tuple([10] * 9)
    order = Blocked(0, 0, sizes, window=3)  # three windows of 30 positions
    for rank, start in ((0, 0), (1, 0), (0, 17), (2, 44)):
        share = RankShare(order, start, rank, 3)
        plan = batches(share, 4, False)
        for b in range(len(plan)):
            pos = share.positions([b * 4])[0]
            w = int(order.window_of([pos])[0])
            expect = tuple(order.window_shards(w + 1).tolist()) if w + 1 < 3 else ()
            assert plan.shards_after(b) == expect
    assert batches(RankShare(Shuffled(0, 0, 90), 0, 0, 1), 4, False).shards_after(0) == ()


def test_window_shards_at_names_the_window_a_batch_starts_in_on_every_rank_and_after_resume():
    sizes = tuple([10] * 9)
    order = Blocked(0, 0, sizes, window=3)
    for rank, start in ((0, 0), (1, 0), (0, 17), (2, 44)):
        share = RankShare(order, start, rank, 3)
        plan = batches(share, 4, False)
        for b in range(len(plan)):
            w = int(order.window_of(share.positions([b * 4]))[0])
            shards = plan.window_shards_at(b)
            assert shards == tuple(order.window_shards(w).tolist())
            first = int(share.at([b * 4])[0])  # the batch's first sample lies in one of them
            assert int(np.searchsorted(np.cumsum(sizes), first, side="right")) in shards
    assert batches(RankShare(Shuffled(0, 0, 90), 0, 0, 1), 4, False).window_shards_at(0) == ()
