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
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def quotas(total: int, weights: Sequence[float]) -> np.ndarray:
    """Per-source counts summing to ``total`` in proportion to ``weights`` (largest remainder;
    ties go to the earlier source)."""
    w = np.asarray(weights, np.float64)
    if total < 0 or not len(w) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0 (got {list(weights)}); total >= 0")
    raw = total * (w / w.sum())
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
