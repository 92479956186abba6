"""A run's timeline: which global batch each training step is, across epochs, resumes, world
sizes and skipped steps, computed, never logged.

A *step* is one batch on every rank (ranks run in lockstep); step numbers count from the start
of the run and carry over every resume, so they match a training loop that restores its step
counter from the same checkpoint. The order is a pure function of (seed, epoch, position)
(order.py), so a step's samples follow from a few numbers: the *spans* of the run (from step
``s``, epoch ``e`` read from position ``p`` by ``W`` ranks in batches of ``B``; a new span starts
only where that changes: a resume on another world size, another batch size, a jump with
``set_epoch``) and the *skips* (position ranges a resume left out: ``load_state_dict(...,
skip_steps=)``). A resume state carries both (a handful of entries), so ``samples_at`` answers
for any step, past or (extrapolated with the last span) future, in O(spans + skips).

Skipped steps keep no number: after ``skip_steps=[(a, b)]`` step ``a`` is the batch that would
have been step ``b``, as a loop that counts its batches sees it; the trace names the skip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from stallfree.loader.epoch.order import UNEVEN, Kept, Order, RankShare

MAX_SPANS = 10_000  # entries a state's history may hold (a state comes from outside)
MAX_SKIPS = 10_000
KEEP_SPANS = 1_000  # spans a loader keeps: beyond, the oldest go (their steps untraceable)


@dataclass(frozen=True)
class Span:
    """From step ``step`` on: epoch ``epoch`` read from position ``start`` by ``world_size`` ranks
    in batches of ``batch_size`` (``drop_last``, ``uneven`` as the loader's), and the epochs
    after it from position 0, until the next span."""

    step: int
    epoch: int
    start: int
    world_size: int
    batch_size: int
    drop_last: bool = False
    uneven: str = "pad"

    def same_reading(self, other: Span) -> bool:
        """Same world size, batch size and tail rule: one extrapolates the other."""
        return (self.world_size, self.batch_size, self.drop_last, self.uneven) == (
            other.world_size,
            other.batch_size,
            other.drop_last,
            other.uneven,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "start": self.start,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "uneven": self.uneven,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Span:
        span = cls(
            step=_count(d, "step"),
            epoch=_count(d, "epoch"),
            start=_count(d, "start"),
            world_size=_count(d, "world_size", low=1),
            batch_size=_count(d, "batch_size", low=1),
            drop_last=_flag(d, "drop_last"),
            uneven=str(d.get("uneven", "pad")),
        )
        if span.uneven not in UNEVEN:
            raise ValueError(f"a history span's 'uneven' is {span.uneven!r}, not one of {UNEVEN}")
        return span


@dataclass(frozen=True)
class Skip:
    """Positions ``[lo, hi)`` of epoch ``epoch`` left out from step ``from_step`` on: what steps
    ``steps[0]..steps[1]-1`` of the timeline before the skip held."""

    epoch: int
    lo: int
    hi: int
    from_step: int
    steps: tuple[int, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "lo": self.lo,
            "hi": self.hi,
            "from_step": self.from_step,
            "steps": list(self.steps),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Skip:
        steps = d.get("steps")
        if not isinstance(steps, (list, tuple)) or len(steps) != 2:
            raise ValueError(f"a skip's 'steps' must be [first, end], got {steps!r}")
        skip = cls(
            epoch=_count(d, "epoch"),
            lo=_count(d, "lo"),
            hi=_count(d, "hi"),
            from_step=_count(d, "from_step"),
            steps=(_count({"s": steps[0]}, "s"), _count({"s": steps[1]}, "s")),
        )
        if skip.hi < skip.lo:
            raise ValueError(f"a skip's range [{skip.lo}, {skip.hi}) is backwards")
        return skip


@dataclass(frozen=True)
class Place:
    """Where a step lies: batch ``batch`` of every rank's share of epoch ``epoch`` as its span
    reads it (from ``start``, with ``skipped`` left out)."""

    step: int
    epoch: int
    batch: int
    span: Span
    start: int
    skipped: tuple[tuple[int, int], ...]

    def share(self, order: Order, rank: int) -> RankShare:
        s = self.span
        return RankShare(order, self.start, rank, s.world_size, s.uneven, self.skipped)

    def positions(self, order: Order, rank: int) -> np.ndarray:
        """The epoch positions of rank ``rank``'s batch at this step."""
        share = self.share(order, rank)
        bs = self.span.batch_size
        k = np.arange(self.batch * bs, min((self.batch + 1) * bs, len(share)), dtype=np.int64)
        return share.positions(k)


@dataclass(frozen=True)
class Timeline:
    """See the module docstring. ``n``: positions per epoch."""

    n: int
    spans: tuple[Span, ...] = ()
    skips: tuple[Skip, ...] = ()

    # -- reading ---------------------------------------------------------------------------
    def skipped_in(self, epoch: int, span: Span) -> tuple[tuple[int, int], ...]:
        """Position ranges of ``epoch`` a span starting at ``span.step`` leaves out."""
        return tuple((k.lo, k.hi) for k in self.skips if k.epoch == epoch and k.from_step <= span.step)

    def batches_in(self, span: Span, epoch: int, start: int) -> int:
        """Batches per rank of ``epoch`` read from ``start`` as ``span`` reads."""
        kept = Kept(self.n, self.skipped_in(epoch, span))
        rest = len(kept) - kept.index(min(start, self.n))
        w, bs = span.world_size, span.batch_size
        share = -(-rest // w) if span.uneven == "pad" else rest // w
        return share // bs if span.drop_last else -(-share // bs)

    def span_at(self, step: int) -> Span:
        if not self.spans or step < self.spans[0].step:
            first = self.spans[0].step if self.spans else None
            raise ValueError(f"step {step} is before this timeline (it starts at step {first})")
        starts = [s.step for s in self.spans]
        return self.spans[int(np.searchsorted(starts, step, side="right")) - 1]

    def place(self, step: int) -> Place:
        """Where ``step`` lies (see ``Place``); past the last span, that span extrapolated."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"a step is an integer >= 0, got {step!r}")
        span = self.span_at(int(step))
        t, e, p = int(step) - span.step, span.epoch, span.start
        first = self.batches_in(span, e, p)
        if t < first:
            return Place(int(step), e, t, span, p, self.skipped_in(e, span))
        t -= first
        e += 1
        with_skips = sorted({k.epoch for k in self.skips if k.epoch >= e and k.from_step <= span.step})
        full = self.batches_in(replace(span, step=-1), e, 0)  # an epoch with nothing skipped
        for skipped_epoch in with_skips + [None]:
            plain = (skipped_epoch - e) if skipped_epoch is not None else None
            if plain is None or t < plain * full:
                if full == 0:
                    raise ValueError(f"step {step}: an epoch of {self.n} positions holds no batch")
                e, t = e + t // full, t % full
                return Place(int(step), e, t, span, 0, self.skipped_in(e, span))
            t -= plain * full
            e = skipped_epoch
            here = self.batches_in(span, e, 0)
            if t < here:
                return Place(int(step), e, t, span, 0, self.skipped_in(e, span))
            t -= here
            e += 1
        raise AssertionError("unreachable")

    def step_of(self, epoch: int, position: int) -> int:
        """The step a consumer that has read epoch ``epoch`` up to ``position`` receives next, as
        the last span reads (``position`` on a batch boundary, as a resume state's is)."""
        if not self.spans:
            raise ValueError("an empty timeline has no steps")
        span = self.spans[-1]
        if (epoch, position) < (span.epoch, span.start):
            raise ValueError(
                f"epoch {epoch} position {position} comes before the timeline's last span "
                f"(epoch {span.epoch} from position {span.start})"
            )
        steps, e, p = 0, span.epoch, span.start
        if e < epoch:
            steps += self.batches_in(span, e, p)
            e, p = e + 1, 0
            with_skips = {k.epoch for k in self.skips if e <= k.epoch < epoch and k.from_step <= span.step}
            full = self.batches_in(replace(span, step=-1), e, 0)
            steps += full * (epoch - e - len(with_skips))
            steps += sum(self.batches_in(span, x, 0) for x in with_skips)
        kept = Kept(self.n, self.skipped_in(epoch, span))
        done = kept.index(min(position, self.n)) - kept.index(p)
        per_step = span.world_size * span.batch_size
        return span.step + steps + -(-done // per_step)

    # -- growing ---------------------------------------------------------------------------
    def extend(self, span: Span) -> Timeline:
        """This timeline with ``span`` where the last span does not already predict it (a
        resume on another world size, a jump); spans from its step on are replaced (a rollback
        to an earlier checkpoint starts the rest again). Only the last ``KEEP_SPANS`` are kept
        (a loop that calls ``set_epoch(0)`` before every pass adds one each time: its state must
        not grow without end, and the oldest steps are the least asked about)."""
        if self.spans:
            last = self.spans[-1]
            if last.step <= span.step and last.same_reading(span):
                try:
                    if self.step_of(span.epoch, span.start) == span.step:
                        return self
                except ValueError:
                    pass
        kept = tuple(s for s in self.spans if s.step < span.step)[-(KEEP_SPANS - 1) :]
        return replace(self, spans=(*kept, span))

    def with_skip(self, first: int, end: int, *, at: Span) -> Timeline:
        """Leave out what steps ``first..end-1`` of this timeline hold, for a run resuming with
        span ``at`` (its step must not come after ``first``: a skip is of steps not yet trained)."""
        if not (isinstance(first, int) and isinstance(end, int)) or first < 0 or end <= first:
            raise ValueError(
                f"a skipped range of steps is (first, end) with 0 <= first < end, got ({first!r}, {end!r})"
            )
        if first < at.step:
            raise ValueError(
                f"cannot skip steps {first}..{end - 1}: the state resumes at step {at.step}, so "
                f"steps before it were already trained on (resume from an earlier checkpoint)"
            )
        if len(self.skips) >= MAX_SKIPS:
            raise ValueError(f"a timeline holds at most {MAX_SKIPS} skips")
        base = self.extend(at)
        ranges: dict[int, list[tuple[int, int]]] = {}
        for step in range(first, end):
            place = base.place(step)
            for lo, hi in _global_batch(base, place):
                runs = ranges.setdefault(place.epoch, [])
                if runs and runs[-1][1] == lo:
                    runs[-1] = (runs[-1][0], hi)
                else:
                    runs.append((lo, hi))
        new = tuple(
            Skip(epoch, lo, hi, at.step, (first, end))
            for epoch, runs in sorted(ranges.items())
            for lo, hi in runs
        )
        spans = (*(s for s in self.spans if s.step < at.step), at)  # ``at`` on: the skip applies
        return replace(self, spans=spans, skips=(*self.skips, *new))

    # -- state ---------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {
            "history": [s.to_dict() for s in self.spans],
            "skips": [k.to_dict() for k in self.skips],
        }

    @classmethod
    def from_state(cls, n: int, history: Sequence[Any], skips: Sequence[Any]) -> Timeline:
        if len(history) > MAX_SPANS or len(skips) > MAX_SKIPS:
            raise ValueError(f"a state's history holds at most {MAX_SPANS} spans and {MAX_SKIPS} skips")
        spans = tuple(Span.from_dict(_mapping(h, "history")) for h in history)
        if any(b.step < a.step for a, b in zip(spans, spans[1:], strict=False)):
            raise ValueError("a state's history spans must be in step order")
        return cls(int(n), spans, tuple(Skip.from_dict(_mapping(k, "skips")) for k in skips))


def _global_batch(timeline: Timeline, place: Place) -> list[tuple[int, int]]:
    """Position ranges the step at ``place`` reads on all ranks together (its padding, repeats
    of the epoch's first positions, aside): a run of kept positions, mapped back."""
    span = place.span
    kept = Kept(timeline.n, place.skipped)
    begin = kept.index(place.start)
    per = span.world_size * span.batch_size
    lo_k = begin + place.batch * per
    hi_k = min(begin + (place.batch + 1) * per, len(kept))
    if hi_k <= lo_k:
        return []
    pos = kept.pos(np.arange(lo_k, hi_k, dtype=np.int64))
    breaks = np.flatnonzero(np.diff(pos) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(pos, breaks)]


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"a state's {where!r} entries must be objects, got {value!r}")
    return value


def _count(d: Mapping[str, Any], name: str, *, low: int = 0) -> int:
    value = d.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name!r} must be an integer >= {low}, got {value!r}")
    return int(value)


def _flag(d: Mapping[str, Any], name: str) -> bool:
    value = d.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{name!r} must be true or false, got {value!r}")
    return value
