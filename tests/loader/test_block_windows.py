"""Block order's windows as pure functions (``Blocked.window_of`` / ``window_shards``,
``Batches.shards_after``): what a worker stages ahead must be exactly the shards the next
window reads, on any rank and after a resume, and never change the order itself."""

import numpy as np

from stallfree.loader.epoch.order import (
    Blocked,
    RankShare,
    Shuffled,
    batches,
    block_order,
    ramp_of,
    window_bounds,
)


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
    order = Blocked(0, 0, sizes, window=3, first=1)  # a first window of 1 shard, then 3, 3 and 2
    assert [len(order.window_shards(w)) for w in range(order.windows)] == [1, 3, 3, 2]
    for rank, start in ((0, 0), (1, 0), (0, 17), (2, 44)):
        share = RankShare(order, start, rank, 3)
        plan = batches(share, 4, False)
        for b in range(len(plan)):
            pos = share.positions([b * 4])[0]
            w = int(order.window_of([pos])[0])
            expect = tuple(order.window_shards(w + 1).tolist()) if w + 1 < order.windows else ()
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


def test_a_short_first_window_and_a_short_tail_joining_the_one_before():
    # why: the first batch waits for the whole first window where windows are staged; a last
    # window shorter than the first would mix fewer shards than any other
    assert window_bounds(13, 8, 2).tolist() == [0, 2, 10, 13]  # 2, then 8, then 3
    assert window_bounds(11, 8, 2).tolist() == [0, 2, 11]  # 2, then 8 + a tail of 1
    assert window_bounds(13, 8).tolist() == [0, 8, 13]  # no first given: full windows, the rest
    assert window_bounds(3, 8, 2).tolist() == [0, 3]
    assert window_bounds(5, 1).tolist() == [0, 1, 2, 3, 4, 5]
    assert window_bounds(0, 8, 2).tolist() == [0]
    for shards in range(1, 40):
        for window in (1, 2, 3, 8):
            for first in (None, ramp_of(window)):
                b = window_bounds(shards, window, first)
                sizes = np.diff(b)
                assert b[0] == 0 and b[-1] == shards and np.all(sizes >= 1)
                lead = min(window if first is None else first, shards)
                assert sizes[0] == (lead if len(sizes) > 1 else shards)
                assert np.all(sizes[1:-1] == window) if len(sizes) > 2 else True
                if len(sizes) > 1 and first is not None:
                    assert sizes[0] <= sizes[-1] < window + sizes[0]
    order = Blocked(5, 0, tuple([4] * 13), window=8, first=ramp_of(8))
    assert [len(order.window_shards(w)) for w in range(order.windows)] == [2, 8, 3]
    assert sorted(order.at(np.arange(order.n)).tolist()) == list(range(52))


def test_the_loader_shortens_the_first_window_only_where_it_stages_windows():
    import fsspec

    from stallfree.loader.options import LoaderOptions, plan
    from tests.loader.helpers import Sharded

    class Remote(Sharded):  # shards on a non-local filesystem: the planner stages block order
        fs = fsspec.filesystem("memory")
        shard_sizes = [6] * 12

        def __init__(self):
            super().__init__()
            self.n = 72

        def warm(self, shards, executor):
            pass

        def shards_of(self, indices):
            return [i // 6 for i in indices]

        def get_many(self, indices, executor=None):
            return [self[i] for i in indices]

    ds = Remote()
    staged = plan(ds, LoaderOptions(batch_size=4, shuffle=True, num_workers=2, order="block"))
    plain = plan(ds, LoaderOptions(batch_size=4, shuffle=True, num_workers=2, order="block", staging=False))
    assert staged.worker.staging is not None and plain.worker.staging is None
    assert staged.source.identity == "block/r1/window=8/first=2"
    assert plain.source.identity == "block/r1/window=8"
    windows = staged.source.epoch_order(0)
    assert [len(windows.window_shards(w)) for w in range(windows.windows)] == [2, 8, 2]
