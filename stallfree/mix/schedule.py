"""Which source fills each position of a mixture's epoch: exact per-epoch counts (``quotas``) laid
out so that every window of positions holds each source's share (``interleave``).

``interleave`` is Tijdeman's algorithm for the chairman assignment problem (R. Tijdeman, 1980):
at each position, among the sources entitled to a sample (``t*f_s - P_s(t-1) >= 1/(2n-2)``) give
it to the one whose next deadline ``(P_s + 1 - 1/(2n-2)) / f_s`` comes first. It guarantees
``|P_s(t) - t*f_s| <= 1 - 1/(2n-2)`` for every prefix ``t``, hence for every window of ``B``
positions (aligned or not) a count within ``2 - 1/(n-1)`` of ``B*f_s``: within one for two
sources, below two for any number. Exactly "within one" for every window is impossible in
general with three or more sources of distinct shares (Fraenkel's balanced-word problem), so
this bound is the contract. The schedule depends on the counts only, never on seed or epoch.

Tijdeman's algorithm decides one position after another, so it is laid out (``Table``) only for
epochs up to ``EXACT_UP_TO`` positions; ``make`` gives longer epochs split.py's schedule, a
function of position with a per-source bound of its own (exactly 1 for two sources).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from stallfree.mix.split import Split


def quotas(total: int, weights: Sequence[float]) -> np.ndarray:
    """Per-source counts summing to ``total`` in proportion to ``weights`` (largest remainder;
    ties go to the earlier source)."""
    w = np.asarray(weights, np.float64)
    with np.errstate(over="ignore"):
        w_sum = w.sum()
    if total < 0 or not len(w) or not np.isfinite(w).all() or (w < 0).any() or w_sum <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0 (got {list(weights)}); total >= 0")
    if not np.isfinite(w_sum):  # each finite, the sum not: every share would be 0 / inf
        raise ValueError(
            f"weights {list(weights)} sum past the largest float; scale them down (only ratios matter)"
        )
    raw = total * (w / w_sum)
    counts = np.floor(raw).astype(np.int64)
    left = total - int(counts.sum())
    counts[np.argsort(-(raw - counts), kind="stable")[:left]] += 1
    return counts


def bound(n_sources: int) -> float:
    """The most a source's count in any window may differ from ``B * share`` (see module doc)."""
    return 1.0 if n_sources <= 2 else 2.0 - 1.0 / (n_sources - 1)


def interleave(counts: Sequence[int]) -> np.ndarray:
    """Source number for each of ``sum(counts)`` positions, ``counts[s]`` of source ``s``."""
    c = [int(x) for x in counts]
    total = sum(c)
    dtype = np.int16 if len(c) < 2**15 else np.int32
    live = [s for s, k in enumerate(c) if k > 0]
    if len(live) <= 1:
        return np.full(total, live[0] if live else 0, dtype)
    delta = 1.0 / (2 * len(live) - 2)
    period = {s: total / c[s] for s in live}  # 1 / f_s
    taken = dict.fromkeys(live, 0)
    ready: list[tuple[float, int]] = []  # (deadline, source) of next samples already released
    waiting = [((delta) * period[s], s) for s in live]  # (release, source)
    heapq.heapify(waiting)
    out = np.empty(total, dtype)
    for t in range(1, total + 1):
        while waiting and waiting[0][0] <= t + 1e-9:
            _, s = heapq.heappop(waiting)
            heapq.heappush(ready, ((taken[s] + 1 - delta) * period[s], s))
        if not ready:  # cannot happen in exact arithmetic; take the earliest release
            _, s = heapq.heappop(waiting)
        else:
            _, s = heapq.heappop(ready)
        out[t - 1] = s
        taken[s] += 1
        if taken[s] < c[s]:
            heapq.heappush(waiting, ((taken[s] + delta) * period[s], s))
    return out


def occurrences(schedule: np.ndarray, n_sources: int) -> np.ndarray:
    """For each position, how many earlier positions went to the same source."""
    occ = np.empty(len(schedule), np.int64)
    for s in range(n_sources):
        where = np.flatnonzero(schedule == s)
        occ[where] = np.arange(len(where))
    return occ


EXACT_UP_TO = 1 << 18  # epochs up to this many positions get Tijdeman's schedule (laid out: ~0.2 s)


class Table:
    """Tijdeman's schedule laid out (``interleave``): the tighter window bound, O(positions) to
    build and hold, so only for epochs up to ``EXACT_UP_TO`` positions (longer ones: split.Split)."""

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = [int(c) for c in counts]
        self._schedule = interleave(self.counts)
        self._occ = occurrences(self._schedule, len(self.counts))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, occurrence of that source before this position) for each position."""
        return self._schedule[positions].astype(np.int64), self._occ[positions]

    def prefix(self, t: int) -> list[int]:
        """Positions of each source among the first ``t``."""
        return np.bincount(self._schedule[:t], minlength=len(self.counts)).tolist()

    def window_bounds(self) -> list[float]:
        """Per source: the most its count in any window may differ from its share (module doc)."""
        live = sum(1 for c in self.counts if c > 0)
        return [bound(live) if c > 0 and live > 1 else 0.0 for c in self.counts]


def make(counts: Sequence[int]) -> Table | Split:
    """The schedule for these per-epoch counts: laid out when short, a function of position
    when long (split.py), so a mixture of 10^9 samples per epoch builds in O(sources)."""
    if sum(int(c) for c in counts) <= EXACT_UP_TO:
        return Table(counts)
    return Split(counts)
