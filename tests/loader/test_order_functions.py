"""Orders as functions (order.py): bijections at any n, shares computed from positions, exact
resume across world sizes at n = 10^6, and simple statistics against numpy's permutation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stallfree.loader.epoch import order
from stallfree.loader.epoch.order import Blocked, RankShare, Shuffled, make_order
from stallfree.mix.permute import keys, permute_each, tweaks

# 1, small primes, powers of two and their neighbours, a prime above 2^16, and an odd big one
_NS = [1, 2, 3, 5, 7, 31, 64, 65, 127, 1000, 4096, 4097, 65537, 100_003]


@pytest.mark.parametrize("n", _NS)
def test_global_order_is_a_bijection(n):
    got = Shuffled(3, 1, n).at(np.arange(n))
    assert np.array_equal(np.sort(got), np.arange(n))
    assert np.array_equal(got, order.global_order(3, 1, n))  # the array is the function materialised


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 65537])
def test_block_order_is_a_bijection_with_empty_shards(n):
    rng = np.random.default_rng(n)
    cuts = np.sort(rng.integers(0, n + 1, size=max(1, n // 40)))
    sizes = np.diff(np.concatenate([[0], cuts, [n]])).tolist()  # some shards empty
    for window in (1, 3, 8):
        got = Blocked(2, 0, tuple(sizes), window).at(np.arange(n))
        assert np.array_equal(np.sort(got), np.arange(n)), (n, window)


def test_positions_are_computed_on_their_own():
    n = 1_000_003
    o = Shuffled(9, 4, n)
    full = o.at(np.arange(n))
    pick = np.array([0, n - 1, 17, 500_000, 17])
    assert np.array_equal(o.at(pick), full[pick])
    b = make_order(9, 4, n, mode="block", shard_sizes=[1000] * 1000 + [3], window=4)
    assert np.array_equal(b.at(pick), order.materialise(b)[pick])
    with pytest.raises(IndexError, match="out of range for an epoch of 1000003"):
        o.at([n])


def test_permute_each_is_a_bijection_per_tweak():
    k = keys(5, 1)
    tw = tweaks(k, np.arange(3))
    sizes = [10, 1, 4097]
    idx = np.concatenate([np.arange(s) for s in sizes])
    which = np.repeat(np.arange(3), sizes)
    got = permute_each(idx, np.array(sizes)[which], k, tw[which])
    for w, s in enumerate(sizes):
        assert np.array_equal(np.sort(got[which == w]), np.arange(s))
    again = permute_each(idx[::-1], np.array(sizes)[which][::-1], k, tw[which][::-1])
    assert np.array_equal(again, got[::-1])  # each element on its own: order and company are irrelevant


def test_share_is_computed_without_the_order_array():
    """A 10^12-sample epoch: a rank's batch is computed from positions (an array would be 8 TB)."""
    n = 10**12
    share = RankShare(Shuffled(1, 0, n), 123_456_789, 517, 1024)
    assert len(share) == -(-(n - 123_456_789) // 1024)
    first = share.slice(0, 256)
    assert len(set(first.tolist())) == 256 and first.min() >= 0 and first.max() < n
    pos = 123_456_789 + 517 + 1024 * np.arange(256)
    assert np.array_equal(first, Shuffled(1, 0, n).at(pos))
    rest = n - 123_456_789
    assert 0 < rest % 1024 <= 1023  # so the last rank's last read is padding
    share = RankShare(Shuffled(1, 0, n), 123_456_789, 1023, 1024)
    last = share.at([len(share) - 1])  # past the end of the rest: the epoch's first positions
    q = 1023 + 1024 * (len(share) - 1) - rest
    assert q >= 0 and last[0] == Shuffled(1, 0, n).at([q])[0]


@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_resume_across_world_sizes_at_a_million(uneven):
    """Saved on W ranks after k samples each, resumed on W2: together every index exactly once
    (drop: the last (n - start) % W2 positions left out; pad: the epoch's first positions again)."""
    n = 1_000_000
    o = Shuffled(7, 2, n)
    for w, k, w2 in [(8, 12_345, 3), (3, 100_000, 1024), (1024, 900, 7), (5, 0, 2)]:
        start = order.consumed_after(0, k, w, n)
        before = np.concatenate([RankShare(o, 0, r, w, uneven).slice(0, k) for r in range(w)])
        after = [RankShare(o, start, r, w2, uneven) for r in range(w2)]
        per = len(after[0])
        assert all(len(s) == per for s in after)
        merged = np.empty(per * w2, np.int64)
        for r, s in enumerate(after):
            merged[r::w2] = s.slice(0, per)
        rest = n - start
        if uneven == "pad":
            seen = np.bincount(np.concatenate([before, merged]), minlength=n)
            pad = (-rest) % w2
            assert len(merged) == rest + pad and seen.min() == 1
            assert np.array_equal(np.flatnonzero(seen == 2), np.sort(o.at(np.arange(pad)))), (w, k, w2)
        else:
            seen = np.bincount(np.concatenate([before, merged]), minlength=n)
            assert seen.max() == 1 and len(merged) == rest - rest % w2
            assert np.array_equal(np.flatnonzero(seen == 0), np.sort(o.at(np.arange(n - rest % w2, n))))


def test_batches_are_lazy_and_iterate_like_indexing():
    share = RankShare(Shuffled(0, 0, 100_000), 10, 1, 3)
    plan = order.batches(share, 256, drop_last=False)
    assert len(plan) == math.ceil(len(share) / 256)
    it = list(plan)
    assert len(it) == len(plan) and all(np.array_equal(it[b], plan[b]) for b in (0, 1, len(plan) - 1))
    assert np.array_equal(np.concatenate(it), share.slice(0, len(share)))
    dropped = order.batches(share, 256, drop_last=True)
    assert all(len(b) == 256 for b in dropped) and dropped.samples == 256 * len(dropped)


# -- statistics against numpy's permutation at n = 10^6 ---------------------------------------------


def _cycles(p: np.ndarray) -> np.ndarray:
    """Lengths of the cycles of permutation ``p`` (pointer doubling: each element learns the
    smallest element of its cycle in log2(n) vectorised steps)."""
    label, jump = np.arange(len(p)), p.copy()
    for _ in range(max(1, math.ceil(math.log2(len(p))))):
        label = np.minimum(label, label[jump])
        jump = jump[jump]
    return np.bincount(label)[np.flatnonzero(label == np.arange(len(p)))]


def _stats(p: np.ndarray) -> dict[str, float]:
    n = len(p)
    x = p.astype(np.float64)
    grid = (p[:-1] * 16 // n) * 16 + p[1:] * 16 // n  # (this value, next value) in a 16 x 16 grid
    counts = np.bincount(grid, minlength=256)
    expect = (n - 1) / 256
    return {
        "neighbour_corr": float(np.corrcoef(x[:-1], x[1:])[0, 1]),
        "position_corr": float(np.corrcoef(np.arange(n), x)[0, 1]),
        "mean_gap": float(np.abs(np.diff(x)).mean() / n),  # uniform pairs: 1/3
        "chi2": float(((counts - expect) ** 2 / expect).sum()),  # 255 degrees of freedom
    }


def test_order_statistics_match_numpy_permutation():
    n, seeds = 1_000_000, range(2)
    ours = [Shuffled(s, 0, n).at(np.arange(n)) for s in seeds]
    numpy = [np.random.default_rng(s).permutation(n) for s in seeds]
    limit = 5 / math.sqrt(n)  # 5 sigma of a correlation between independent uniforms
    chi2_limit = 255 + 6 * math.sqrt(2 * 255)
    for name, perms in (("ours", ours), ("numpy", numpy)):
        for p in perms:
            st = _stats(p)
            assert abs(st["neighbour_corr"]) < limit and abs(st["position_corr"]) < limit, (name, st)
            assert abs(st["mean_gap"] - 1 / 3) < 0.002, (name, st)
            assert st["chi2"] < chi2_limit, (name, st)
    # cycle structure: a uniform permutation has H_n ~ 14.4 cycles (sd ~ 3.6), ~1 fixed point, and
    # each element's cycle length uniform on 1..n (so about half the elements in cycles > n/2)
    harmonic = sum(1 / k for k in range(1, n + 1))
    for name, perms in (("ours", ours), ("numpy", numpy)):
        lengths = [_cycles(p) for p in perms]
        mean_cycles = np.mean([len(c) for c in lengths])
        assert abs(mean_cycles - harmonic) < 3 * 3.8 / math.sqrt(len(perms)), (name, mean_cycles)
        assert np.mean([int((c == 1).sum()) for c in lengths]) < 4, name
        assert all(c.sum() == n for c in lengths)
    # and the orders of different epochs and seeds are unrelated
    assert abs(np.corrcoef(ours[0], ours[1])[0, 1]) < limit
    assert abs(np.corrcoef(ours[0], Shuffled(0, 1, n).at(np.arange(n)))[0, 1]) < limit


def test_loader_starts_a_billion_sample_epoch_from_positions():
    from stallfree import DataLoader

    class Huge(torch.utils.data.Dataset):
        def __len__(self):
            return 10**9

        def __getitem__(self, i):
            return i

    dl = DataLoader(Huge(), batch_size=8, shuffle=True, seed=5, world=(2, 3))
    first = next(iter(dl))
    want = Shuffled(5, 0, 10**9).at(2 + 3 * np.arange(8))
    assert first.tolist() == want.tolist()
    assert len(dl) == math.ceil(math.ceil(10**9 / 3) / 8)
