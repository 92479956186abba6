"""Which source fills each *global* position under a weight schedule (weights.py), in O(1) per
position: ``Staged.locate(g)`` -> (source, occurrence of that source before ``g``).

Each finite segment of the schedule gets exact counts (``schedule.quotas`` of its length, so
largest remainder per segment) laid out as today's constant mixtures are (``schedule.make``:
Tijdeman's algorithm up to ``EXACT_UP_TO`` positions, split.py's line beyond): within a segment
every window of positions keeps that bound; a window cut by a segment boundary holds a part of
each, each within its own bound. The unbounded last segment is split.py's Bresenham tree over
shares of ``2**30`` (its lines hold for any length), so it needs no end and no period.

Occurrence numbers are global (segments before add their counts: one cumulative table), so a
source's samples are read in whole keyed permutations (cycles) over the whole run, across epoch
and stage boundaries alike. Segment layouts are built when first asked and kept (a few), so a
lookup costs one ``searchsorted`` and the segment's own O(depth) arithmetic.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from stallfree.mix import schedule as sched_mod
from stallfree.mix.split import LIMIT, Split
from stallfree.mix.weights import Segments

TAIL_TOTAL = 1 << 30  # the unbounded segment's shares are counts out of this many
_KEEP = 64  # segment layouts kept built


def quota_rows(lengths: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``schedule.quotas(length_k, weights_k)`` for every row at once (largest remainder; ties
    to the earlier source): one vectorised pass over a schedule's segments."""
    w = weights / weights.sum(axis=1, keepdims=True)
    raw = lengths[:, None].astype(np.float64) * w
    counts = np.floor(raw).astype(np.int64)
    left = lengths - counts.sum(axis=1)
    rank = np.argsort(np.argsort(-(raw - counts), axis=1, kind="stable"), axis=1, kind="stable")
    counts += rank < left[:, None]
    return counts


class Staged:
    """See the module docstring. ``segments``: the schedule laid out for the mixture's sources."""

    def __init__(self, segments: Segments) -> None:
        self.segments = segments
        starts = np.asarray(segments.starts, np.int64)
        self.starts = starts
        self.n_sources = len(segments.names)
        finite = np.diff(starts)
        self.counts = (
            quota_rows(finite, segments.weights[:-1])
            if len(finite)
            else np.zeros((0, self.n_sources), np.int64)
        )
        self.before = np.vstack([np.zeros((1, self.n_sources), np.int64), np.cumsum(self.counts, axis=0)])
        tail = sched_mod.quotas(TAIL_TOTAL, segments.weights[-1].tolist())
        self._tail = Split(tail)
        self._built: OrderedDict[int, sched_mod.Table | Split] = OrderedDict()

    @property
    def end(self) -> int:
        """Where the unbounded last segment starts."""
        return int(self.starts[-1])

    def _layout(self, k: int) -> sched_mod.Table | Split:
        if k == len(self.starts) - 1:
            return self._tail
        got = self._built.get(k)
        if got is None:
            got = sched_mod.make(self.counts[k])
            self._built[k] = got
            if len(self._built) > _KEEP:
                self._built.popitem(last=False)
        else:
            self._built.move_to_end(k)
        return got

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, occurrences of that source before the position) for global positions."""
        g = np.asarray(positions, np.int64).reshape(-1)
        if len(g) and (g.min() < 0 or g.max() - self.end >= LIMIT):
            raise IndexError(f"global position outside 0..{self.end + LIMIT - 1} of a weight schedule")
        seg = np.searchsorted(self.starts, g, side="right") - 1
        src = np.empty(len(g), np.int64)
        occ = np.empty(len(g), np.int64)
        for k in np.unique(seg).tolist():
            where = np.flatnonzero(seg == k)
            s, o = self._layout(k).locate(g[where] - self.starts[k])
            src[where] = s
            occ[where] = o + self.before[k][s]
        return src, occ

    def prefix(self, t: int) -> list[int]:
        """Positions of each source among global positions ``[0, t)``."""
        t = int(t)
        k = int(np.searchsorted(self.starts, t, side="right") - 1)
        inside = self._layout(k).prefix(t - int(self.starts[k]))
        return [int(a) + int(b) for a, b in zip(self.before[k].tolist(), inside, strict=True)]

    def window_bounds(self) -> list[float]:
        """Per source, the largest bound over the segments it appears in (schedule.py, split.py):
        the most its count in a window *inside one segment* may differ from its share there."""
        out = [0.0] * self.n_sources
        for k in range(len(self.starts) - 1):
            live = int((self.counts[k] > 0).sum())
            if live <= 1:
                continue
            if int(self.counts[k].sum()) <= sched_mod.EXACT_UP_TO:
                b = sched_mod.bound(live)
                for s in np.flatnonzero(self.counts[k] > 0).tolist():
                    out[s] = max(out[s], b)
            else:
                out = [max(a, b) for a, b in zip(out, Split(self.counts[k]).window_bounds(), strict=True)]
        return [max(a, b) for a, b in zip(out, self._tail.window_bounds(), strict=True)]
