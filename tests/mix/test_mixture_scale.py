"""Mixtures of long epochs: the schedule as a function of position (split.py), O(sources) to build,
exact counts and occurrences, windows within its stated bound; weights that overflow."""

from __future__ import annotations

import numpy as np
import pytest

import stallfree
from stallfree.mix import schedule
from stallfree.mix.mixture import Mixture
from stallfree.mix.split import Split


class Sized:
    """A map-style dataset of any length whose samples are their index (nothing stored)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"i": i}


_COUNTS = [[700, 300], [1, 1, 1], [500, 300, 150, 50], [5, 3, 2], [997, 1, 0, 2], [13, 29, 31, 37, 41, 2]]


@pytest.mark.parametrize("counts", _COUNTS)
def test_split_counts_occurrences_and_prefixes_are_exact(counts):
    sched = Split(counts)
    total = sum(counts)
    src, occ = sched.locate(np.arange(total))
    assert np.bincount(src, minlength=len(counts)).tolist() == counts
    for s in range(len(counts)):
        assert np.array_equal(occ[src == s], np.arange(counts[s]))  # k-th position of s is its k-th sample
    for t in (0, 1, total // 3, total - 1, total):
        assert sched.prefix(t) == np.bincount(src[:t], minlength=len(counts)).tolist()


@pytest.mark.parametrize("counts", _COUNTS)
def test_split_windows_within_the_stated_bound_over_two_epochs(counts):
    sched = Split(counts)
    total = sum(counts)
    src, _ = sched.locate(np.arange(total))
    two = np.concatenate([src, src])  # the schedule repeats each epoch: windows across the boundary
    bounds = sched.window_bounds()
    live = sum(1 for c in counts if c)
    for s, c in enumerate(counts):
        if live == 2 and c:
            assert bounds[s] == 1.0  # two sources: the same bound as Tijdeman's
        p = np.concatenate([[0], np.cumsum(two == s)])
        for b in [x for x in (1, 2, 3, 7, 16, 100, 333) if x < total] + [total]:
            dev = np.abs(p[b:] - p[:-b] - b * c / total).max()
            assert dev <= bounds[s] + 1e-9, (counts, s, b, dev)


def test_long_epoch_builds_from_counts_and_reads_any_position():
    ds = {"web": Sized(3 * 10**9), "code": Sized(10**8), "math": Sized(7 * 10**6)}
    m = stallfree.mix(ds, {"web": 0.7, "code": 0.2, "math": 0.1}, samples_per_epoch=10**9, seed=3)
    assert isinstance(m._schedule, Split) and len(m) == 10**9
    assert m.counts(0, 10**9) == m.quotas == {"code": 200_000_000, "math": 100_000_000, "web": 700_000_000}
    pos = np.array([0, 1, 123_456_789, 10**9 - 1])
    src, j = m.locate_many(pos, epoch=2)
    for p, s, i in zip(pos.tolist(), src.tolist(), j.tolist(), strict=True):
        name = m.names[s]
        assert 0 <= i < m.lengths[name]
        assert m.locate(p, epoch=2) == (name, i) and m.source_of(p) == name
    batch = m.get_many(range(10**9 - 256, 10**9))
    assert len(batch) == 256 and {b["__source__"] for b in batch} <= set(m.names)
    c = m.counts(500_000_000, 500_001_000)
    assert sum(c.values()) == 1000 and abs(c["web"] - 700) <= m.window_bound("web")


def test_math_source_cycles_through_a_fresh_permutation_in_a_long_epoch():
    """math: 40,000 positions over 7,000 samples: 5.7 cycles, each a fresh permutation."""
    m = Mixture(
        {"web": Sized(10**9), "math": Sized(7_000)}, {"web": 0.9, "math": 0.1}, samples_per_epoch=400_000
    )
    assert isinstance(m._schedule, Split)
    pos = np.arange(400_000)
    src, j = m.locate_many(pos)
    mine = j[src == m.names.index("math")]
    assert len(mine) == 40_000
    for cycle in range(5):
        assert np.array_equal(np.sort(mine[cycle * 7000 : (cycle + 1) * 7000]), np.arange(7000))
    assert not np.array_equal(mine[:7000], mine[7000:14000])


def test_short_epochs_keep_tijdemans_schedule():
    m = Mixture({"a": Sized(10), "b": Sized(10), "c": Sized(10)}, {"a": 1, "b": 1, "c": 1})
    assert isinstance(m._schedule, schedule.Table) and m.window_bound("a") == schedule.bound(3)
    assert m.counts(0, 30) == {"a": 10, "b": 10, "c": 10} and m.counts(5, 5) == {"a": 0, "b": 0, "c": 0}


def test_weights_whose_sum_overflows_are_a_clear_error():
    with pytest.raises(ValueError, match="sum past the largest float; scale them down"):
        stallfree.mix({"a": Sized(5), "b": Sized(5)}, {"a": 1e308, "b": 1e308})
    m = stallfree.mix({"a": Sized(5), "b": Sized(5)}, {"a": 1e307, "b": 4e307})  # large but summable
    assert m.quotas == {"a": 2, "b": 8}


def test_epoch_past_the_exact_arithmetic_is_refused():
    with pytest.raises(ValueError, match="at most"):
        Split([1 << 39, 1 << 39])
