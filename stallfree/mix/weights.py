"""Mixture weights that change with training progress: stages, linear, cosine, a user function.

A schedule is keyed on the *global sample position* ``g = epoch * samples_per_epoch + position``
(never on steps, ranks or workers), so it is the same on any world size and batch size, and a
resume at any position continues it exactly.

Every schedule is laid out as *segments*: runs of positions with constant weights. ``stages``
are their own segments; ``linear``, ``cosine`` and ``from_function`` are sampled once every
``resolution`` positions (at each segment's midpoint), so the weights move in steps of
``resolution`` samples. The last segment is unbounded: its weights hold for ever after. The
layout (``segments``) is two arrays, ``starts`` and ``weights``, computed vectorised, so a
schedule over 10^9 samples at a resolution of 4096 builds in milliseconds.

Why a user function is evaluated once, here: the weights table it yields is part of the
mixture's identity (``describe``: a digest of the table), so a resume with a function that
returns other values (not deterministic, or edited) is refused instead of silently reading
another order; and the workers get the table, never the function (it need not pickle).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_RESOLUTION = 4096
MAX_SEGMENTS = 1 << 22  # a schedule laid out into more is refused (raise resolution=)


@dataclass(frozen=True)
class Segments:
    """A schedule laid out: segment ``k`` covers global positions ``[starts[k], starts[k+1])``
    (the last one has no end) with relative weights ``weights[k]`` (one column per source, in
    the order of ``names``)."""

    names: tuple[str, ...]
    starts: np.ndarray  # int64 (K,), starts[0] == 0, increasing
    weights: np.ndarray  # float64 (K, S), each row finite, >= 0, with a positive sum

    def segment_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, positions, side="right") - 1

    def shares_at(self, position: int) -> dict[str, float]:
        """Target shares (summing to 1) at a global position."""
        row = self.weights[int(self.segment_of(np.array([position]))[0])]
        return {n: float(w) for n, w in zip(self.names, row / row.sum(), strict=True)}


class Schedule:
    """Base of the weight schedules: ``names`` (the sources it weighs), ``layout(names)`` ->
    ``Segments`` and ``describe()`` -> plain JSON naming it exactly (the mixture's identity)."""

    names: tuple[str, ...]

    def layout(self, names: Sequence[str]) -> Segments:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


def _weights_row(weights: Mapping[str, float], names: Sequence[str], where: str) -> np.ndarray:
    if not isinstance(weights, Mapping):
        raise TypeError(f"{where}: weights must be a mapping source -> weight, got {type(weights).__name__}")
    if set(weights) != set(names):
        raise ValueError(
            f"{where}: weights name {sorted(weights)}, the mixture's sources are {sorted(names)}"
        )
    row = np.empty(len(names), np.float64)
    for i, n in enumerate(names):
        w = weights[n]
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise TypeError(f"{where}: weight of {n!r} must be a number, got {w!r}")
        if not math.isfinite(float(w)) or float(w) < 0:
            raise ValueError(f"{where}: weight of {n!r} must be a finite number >= 0, got {w!r}")
        row[i] = float(w)
    if row.sum() <= 0 or not math.isfinite(float(row.sum())):
        raise ValueError(
            f"{where}: weights must not be all 0 (and must sum to a finite number), got {dict(weights)}"
        )
    return row


def _position(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{where} must be a global sample position (an integer >= 0), got {value!r}")
    return int(value)


def _resolution(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"resolution must be a positive number of samples, got {value!r}")
    return int(value)


def _points(
    points: Sequence[tuple[int, Mapping[str, float]]], kind: str
) -> list[tuple[int, dict[str, float]]]:
    if isinstance(points, Mapping):
        points = sorted(points.items())
    out = []
    for i, item in enumerate(points):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"{kind}: point {i} must be (position, weights), got {item!r}")
        pos = _position(item[0], f"{kind}: point {i}'s position")
        if not isinstance(item[1], Mapping):
            raise TypeError(
                f"{kind}: point {i}'s weights must be a mapping source -> weight, got {item[1]!r}"
            )
        out.append((pos, dict(item[1])))
    if not out:
        raise ValueError(f"{kind} needs at least one (position, weights) point")
    if out[0][0] != 0:
        raise ValueError(
            f"{kind}: the first point must be at position 0 (where training starts), got {out[0][0]}"
        )
    for (a, _), (b, _) in zip(out, out[1:], strict=False):
        if b <= a:
            raise ValueError(f"{kind}: positions must increase, got {a} then {b}")
    for pos, w in out:
        _weights_row(w, sorted(w), f"{kind}: the point at {pos}")  # values checked now, names at layout
    names = set(out[0][1])
    for pos, w in out:
        if set(w) != names:
            raise ValueError(f"{kind}: the point at {pos} names {sorted(w)}, the first names {sorted(names)}")
    return out


def _grid(lo: int, hi: int, resolution: int) -> np.ndarray:
    """Segment starts covering ``[lo, hi)`` every ``resolution`` positions."""
    count = -(-(hi - lo) // resolution)
    if count > MAX_SEGMENTS:
        raise ValueError(
            f"the schedule's span of {hi - lo} positions at resolution={resolution} is {count} segments, "
            f"over {MAX_SEGMENTS}: raise resolution="
        )
    return lo + resolution * np.arange(count, dtype=np.int64)


def _mids(starts: np.ndarray, hi: int) -> np.ndarray:
    ends = np.append(starts[1:], hi)
    return (starts + ends) / 2.0


@dataclass(frozen=True)
class Stages(Schedule):
    """Piecewise-constant weights: ``[(0, w0), (p1, w1), ...]`` — ``w_k`` from position ``p_k``
    until the next point, the last for ever after."""

    points: tuple[tuple[int, tuple[tuple[str, float], ...]], ...]
    names: tuple[str, ...] = field(init=False)

    def __init__(self, points: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        pts = _points(points, "stages")
        object.__setattr__(self, "points", tuple((p, tuple(sorted(w.items()))) for p, w in pts))
        object.__setattr__(self, "names", tuple(sorted(pts[0][1])))

    def layout(self, names: Sequence[str]) -> Segments:
        starts = np.array([p for p, _ in self.points], np.int64)
        rows = [_weights_row(dict(w), names, f"stages: the stage at {p}") for p, w in self.points]
        return Segments(tuple(names), starts, np.stack(rows))

    def describe(self) -> dict[str, Any]:
        return {"kind": "stages", "points": [[p, dict(w)] for p, w in self.points]}

    def __repr__(self) -> str:
        return f"stages({', '.join(f'{p}: {dict(w)}' for p, w in self.points)})"


@dataclass(frozen=True)
class Linear(Schedule):
    """Weights interpolated linearly between points ``[(0, w0), (p1, w1), ...]`` (each source's
    weight on its own), sampled every ``resolution`` positions; the last point's for ever after."""

    points: tuple[tuple[int, tuple[tuple[str, float], ...]], ...]
    resolution: int = DEFAULT_RESOLUTION
    names: tuple[str, ...] = field(init=False)

    def __init__(
        self, points: Sequence[tuple[int, Mapping[str, float]]], *, resolution: int = DEFAULT_RESOLUTION
    ) -> None:
        pts = _points(points, "linear")
        object.__setattr__(self, "points", tuple((p, tuple(sorted(w.items()))) for p, w in pts))
        object.__setattr__(self, "resolution", _resolution(resolution))
        object.__setattr__(self, "names", tuple(sorted(pts[0][1])))
        _grid(0, pts[-1][0], self.resolution)  # too many segments: refused now, not at first use

    def layout(self, names: Sequence[str]) -> Segments:
        pos = np.array([p for p, _ in self.points], np.float64)
        rows = np.stack([_weights_row(dict(w), names, f"linear: the point at {p}") for p, w in self.points])
        end = int(pos[-1])
        starts = _grid(0, end, self.resolution) if end > 0 else np.zeros(0, np.int64)
        mids = _mids(starts, end)
        table = np.stack([np.interp(mids, pos, rows[:, s]) for s in range(len(names))], axis=1)
        return Segments(
            tuple(names), np.append(starts, end), np.vstack([table.reshape(-1, len(names)), rows[-1:]])
        )

    def __repr__(self) -> str:
        points = ", ".join(f"{p}: {dict(w)}" for p, w in self.points)
        return f"linear({points}; resolution={self.resolution})"

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "linear",
            "resolution": self.resolution,
            "points": [[p, dict(w)] for p, w in self.points],
        }


@dataclass(frozen=True)
class Cosine(Schedule):
    """Weights moving from ``start_weights`` to ``end_weights`` along half a cosine between
    positions ``start`` and ``end`` (slow, fast, slow: an annealing phase), sampled every
    ``resolution`` positions; ``start_weights`` before, ``end_weights`` after."""

    start_weights: tuple[tuple[str, float], ...]
    end_weights: tuple[tuple[str, float], ...]
    start: int
    end: int
    resolution: int = DEFAULT_RESOLUTION
    names: tuple[str, ...] = field(init=False)

    def __init__(
        self,
        start_weights: Mapping[str, float],
        end_weights: Mapping[str, float],
        *,
        start: int = 0,
        end: int,
        resolution: int = DEFAULT_RESOLUTION,
    ) -> None:
        lo, hi = _position(start, "cosine: start"), _position(end, "cosine: end")
        if hi <= lo:
            raise ValueError(f"cosine: end ({hi}) must come after start ({lo})")
        if not isinstance(start_weights, Mapping) or not isinstance(end_weights, Mapping):
            raise TypeError("cosine: start_weights and end_weights must be mappings source -> weight")
        if set(start_weights) != set(end_weights):
            raise ValueError(
                f"cosine: start_weights name {sorted(start_weights)}, end_weights {sorted(end_weights)}"
            )
        _weights_row(start_weights, sorted(start_weights), "cosine: start_weights")
        _weights_row(end_weights, sorted(end_weights), "cosine: end_weights")
        _grid(lo, hi, _resolution(resolution))
        object.__setattr__(self, "start_weights", tuple(sorted(start_weights.items())))
        object.__setattr__(self, "end_weights", tuple(sorted(end_weights.items())))
        object.__setattr__(self, "start", lo)
        object.__setattr__(self, "end", hi)
        object.__setattr__(self, "resolution", _resolution(resolution))
        object.__setattr__(self, "names", tuple(sorted(start_weights)))

    def layout(self, names: Sequence[str]) -> Segments:
        a = _weights_row(dict(self.start_weights), names, "cosine: start_weights")
        b = _weights_row(dict(self.end_weights), names, "cosine: end_weights")
        starts = _grid(self.start, self.end, self.resolution)
        u = (_mids(starts, self.end) - self.start) / (self.end - self.start)
        along = (1.0 - np.cos(np.pi * u)) / 2.0  # 0 at start, 1 at end
        table = a[None, :] + (b - a)[None, :] * along[:, None]
        head_starts = np.zeros(1, np.int64) if self.start > 0 else np.zeros(0, np.int64)
        head = a[None, :] if self.start > 0 else np.zeros((0, len(names)))
        return Segments(
            tuple(names),
            np.concatenate([head_starts, starts, [self.end]]).astype(np.int64),
            np.vstack([head, table, b[None, :]]),
        )

    def __repr__(self) -> str:
        a, b = dict(self.start_weights), dict(self.end_weights)
        return f"cosine({a} -> {b} over {self.start}..{self.end}; resolution={self.resolution})"

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "cosine",
            "start": self.start,
            "end": self.end,
            "resolution": self.resolution,
            "start_weights": dict(self.start_weights),
            "end_weights": dict(self.end_weights),
        }


class FromFunction(Schedule):
    """``fn(progress) -> weights`` with ``progress = position / total`` in [0, 1], evaluated at
    the midpoint of every ``resolution`` positions of ``[0, total)``, and ``fn(1.0)`` after.
    ``fn`` must be deterministic: its table is part of the mixture's identity (module doc)."""

    def __init__(
        self,
        fn: Callable[[float], Mapping[str, float]],
        *,
        total: int,
        names: Sequence[str] | None = None,
        resolution: int = DEFAULT_RESOLUTION,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"from_function needs a callable progress -> weights, got {type(fn).__name__}")
        self.total = _position(total, "from_function: total")
        if self.total == 0:
            raise ValueError("from_function: total must be > 0 (the samples over which progress runs 0 -> 1)")
        self.resolution = _resolution(resolution)
        if names is None:
            first = fn(0.0)
            if not isinstance(first, Mapping):
                raise TypeError(
                    f"from_function: fn(0.0) must return a mapping source -> weight, got {first!r}"
                )
            names = list(first)
        self.names = tuple(sorted(names))
        starts = _grid(0, self.total, self.resolution)
        progress = _mids(starts, self.total) / self.total
        rows = [self._row(fn, float(p)) for p in progress.tolist()] + [self._row(fn, 1.0)]
        self._segments = Segments(self.names, np.append(starts, self.total), np.stack(rows))
        digest = hashlib.sha256(self._segments.weights.tobytes() + self._segments.starts.tobytes())
        self._digest = digest.hexdigest()[:32]

    def _row(self, fn: Callable[[float], Mapping[str, float]], progress: float) -> np.ndarray:
        return _weights_row(fn(progress), self.names, f"from_function: fn({progress!r})")

    def layout(self, names: Sequence[str]) -> Segments:
        if tuple(sorted(names)) != self.names or tuple(names) != self.names:
            raise ValueError(
                f"from_function: made for sources {list(self.names)}, the mixture has {list(names)}"
            )
        return self._segments

    def describe(self) -> dict[str, Any]:
        return {"kind": "function", "total": self.total, "resolution": self.resolution, "table": self._digest}

    def __repr__(self) -> str:
        return f"FromFunction(total={self.total}, resolution={self.resolution}, table={self._digest})"


def stages(points: Sequence[tuple[int, Mapping[str, float]]]) -> Stages:
    """Piecewise-constant weights from global sample positions: ``[(0, w0), (p1, w1), ...]``."""
    return Stages(points)


def linear(
    points: Sequence[tuple[int, Mapping[str, float]]], *, resolution: int = DEFAULT_RESOLUTION
) -> Linear:
    """Weights interpolated linearly between ``(position, weights)`` points."""
    return Linear(points, resolution=resolution)


def cosine(
    start_weights: Mapping[str, float],
    end_weights: Mapping[str, float],
    *,
    start: int = 0,
    end: int,
    resolution: int = DEFAULT_RESOLUTION,
) -> Cosine:
    """Weights moving from ``start_weights`` to ``end_weights`` along half a cosine."""
    return Cosine(start_weights, end_weights, start=start, end=end, resolution=resolution)


def from_function(
    fn: Callable[[float], Mapping[str, float]],
    *,
    total: int,
    names: Sequence[str] | None = None,
    resolution: int = DEFAULT_RESOLUTION,
) -> FromFunction:
    """Weights from a deterministic ``fn(progress)``, progress running 0 -> 1 over ``total`` samples."""
    return FromFunction(fn, total=total, names=names, resolution=resolution)
