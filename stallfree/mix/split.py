"""A mixture's schedule as a function of position, for epochs too long to lay out (``Split``).

A binary tree over the sources, split so each node's two sides carry about equal counts; at a
node of ``T`` positions whose left side holds ``A`` of them, position ``t`` goes left iff
``L(t+1) > L(t)`` with ``L(t) = floor(t*A/T + 1/2)`` (a Bresenham line, exact in integers), and
is then position ``L(t)`` of the left side's positions (or ``t - L(t)`` of the right's). So a
position's source and its occurrence number in that source come from ``depth`` integer steps,
vectorised over a batch, and building the schedule costs O(sources) whatever the epoch's length.

Why not Tijdeman's algorithm (schedule.py) everywhere: it decides positions one after another
from the counts so far, so an epoch of 10^9 positions is 10^9 Python steps and 1-2 GB before
the first batch. The price is a looser window bound for three or more sources: at one node,
``|L(t) - t*A/T| <= 1/2``, so in any window of ``B`` positions a side's count is within 1 of
``B*A/T``; a source ``s`` whose path from the root has shares ``r_1`` (of its parent), ``r_2``
(of the parent's parent), ... gets ``|count - B*f_s| <= 1 + r_1*(1 + r_2*(1 + ...))``
(``window_bounds``): exactly 1 for two sources, below 2 for equal shares, and for skewed shares
of many sources up to about 2.7 (the largest over 300 random mixtures of 3-11 sources; Tijdeman:
below 2 for any shares). Measured deviations stay well inside these bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LIMIT = 1 << 40  # positions per epoch the integer arithmetic below is exact for


def _split_floor(t: np.ndarray, a: int, c: int, d: int) -> np.ndarray:
    """``floor((t*a + c) / d)`` exact in int64 for ``t, a, c, d < 2**42`` (``t*a`` itself would
    overflow): ``a = a1 * 2**21 + a0``, and the high part is divided first."""
    a1, a0 = a >> 21, a & ((1 << 21) - 1)
    q1, r1 = np.divmod(t * a1, d)
    return q1 * (1 << 21) + (r1 * (1 << 21) + t * a0 + c) // d


def _left_before(t: np.ndarray, left: int, total: int) -> np.ndarray:
    """``L(t) = floor(t*left/total + 1/2)``: how many of a node's first ``t`` positions go left."""
    return _split_floor(t, 2 * left, total, 2 * total)


@dataclass(frozen=True)
class _Node:
    total: int
    left: int  # positions going to the left child
    lo: _Node | int  # a child node, or a source number (a leaf)
    hi: _Node | int


def _build(sources: list[tuple[int, int]]) -> _Node | int:
    """Tree over (source, count) pairs with both sides of each node about equally loaded
    (largest first, each to the lighter side)."""
    if len(sources) == 1:
        return sources[0][0]
    sides: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
    load = [0, 0]
    for s, c in sorted(sources, key=lambda sc: (-sc[1], sc[0])):
        side = 0 if load[0] <= load[1] else 1
        sides[side].append((s, c))
        load[side] += c
    return _Node(load[0] + load[1], load[0], _build(sides[0]), _build(sides[1]))


class Split:
    """See the module docstring. ``counts[s]`` positions of source ``s``, ``sum(counts)`` in all."""

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = [int(c) for c in counts]
        self.total = sum(self.counts)
        if self.total >= LIMIT:
            raise ValueError(f"a mixture epoch holds at most {LIMIT - 1} positions, got {self.total}")
        live = [(s, c) for s, c in enumerate(self.counts) if c > 0]
        self._root: _Node | int = _build(live) if live else 0

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, occurrence of that source before this position) for each position."""
        pos = np.asarray(positions, np.int64)
        src = np.empty(len(pos), np.int64)
        occ = np.empty(len(pos), np.int64)
        todo = [(self._root, np.arange(len(pos)), pos)]
        while todo:
            node, where, t = todo.pop()
            if not isinstance(node, _Node):
                src[where], occ[where] = node, t
                continue
            before = _left_before(t, node.left, node.total)
            left = _left_before(t + 1, node.left, node.total) > before
            todo.append((node.lo, where[left], before[left]))
            todo.append((node.hi, where[~left], (t - before)[~left]))
        return src, occ

    def prefix(self, t: int) -> list[int]:
        """Positions of each source among the first ``t``."""
        out = [0] * len(self.counts)
        todo: list[tuple[_Node | int, int]] = [(self._root, int(t))]
        while todo:
            node, k = todo.pop()
            if not isinstance(node, _Node):
                out[node] += k
                continue
            left = int(_left_before(np.array([k]), node.left, node.total)[0])
            todo += [(node.lo, left), (node.hi, k - left)]
        return out

    def window_bounds(self) -> list[float]:
        """Per source: the most its count in any window of ``B`` positions may differ from
        ``B * count / total`` (see the module docstring); 0 for an absent or only source."""
        out = [0.0] * len(self.counts)

        def walk(node: _Node | int, above: float) -> None:
            if isinstance(node, _Node):
                for child, size in ((node.lo, node.left), (node.hi, node.total - node.left)):
                    walk(child, 1.0 + size / node.total * above)
            else:
                out[node] = above

        if isinstance(self._root, _Node):
            walk(self._root, 0.0)
        return out
