"""A loader's step count and timeline (timeline.py): which step the next batch is, the spans
the run has read so far, the skips a resume asked for, and their part of a resume state.

Kept apart from dataloader.py so the loader only tells it when an epoch starts and asks it
for the numbers; everything here is arithmetic on positions, no reads and no processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stallfree.loader.epoch.progress import EpochProgress
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.epoch.timeline import Span, Timeline


class StepClock:
    """Steps of one loader reading our order: ``world_size`` ranks, batches of ``batch_size``."""

    def __init__(self, n: int, world_size: int, batch_size: int, drop_last: bool, uneven: str) -> None:
        self.reading = Span(0, 0, 0, world_size, batch_size, drop_last, uneven)
        self.timeline = Timeline(n)
        self._step = 0  # the next batch's step while no iterator counts
        self._first = 0  # the step of the current iterator's first batch
        self._progress: EpochProgress | None = None

    def now(self) -> int:
        """The step the next batch the consumer receives will have."""
        p = self._progress
        if p is None:
            return self._step
        return self._first + -(-p.received // self.reading.batch_size)

    def span_for(self, epoch: int, start: int, step: int | None = None) -> Span:
        r = self.reading
        return Span(
            self.now() if step is None else step,
            epoch,
            start,
            r.world_size,
            r.batch_size,
            r.drop_last,
            r.uneven,
        )

    def starting(self, epoch: int, start: int) -> tuple[int, tuple[tuple[int, int], ...]]:
        """An epoch starts at ``start``: (its first step, the position ranges it leaves out)."""
        step = self.now()
        self.timeline = self.timeline.extend(self.span_for(epoch, start, step))
        self._first, self._step = step, step
        return step, self.skipped(epoch)

    def started(self, progress: EpochProgress) -> None:
        """The epoch's iterator exists: count its batches from now on."""
        self._progress = progress

    def skipped(self, epoch: int) -> tuple[tuple[int, int], ...]:
        """Position ranges of ``epoch`` left out as the run reads now."""
        if not self.timeline.spans:
            return ()
        return self.timeline.skipped_in(epoch, self.timeline.spans[-1])

    def preview(self, epoch: int, start: int) -> Timeline:
        """The timeline with the span the next iterator would add (for ``samples_at`` before it)."""
        return self.timeline.extend(self.span_for(epoch, start))

    def state_fields(self) -> dict[str, Any]:
        return {"step": self.now(), **_tuples(self.timeline.to_state())}

    def restore(
        self, state: LoaderState, skip_steps: Sequence[tuple[int, int]] = (), *, start: int | None = None
    ) -> None:
        """Continue the state's timeline (a state saved before steps were recorded starts a new
        one at step 0), leaving out ``skip_steps`` of it: every rank leaves out the same global
        batches, as the state's run read them (its world size and batch size)."""
        n = self.timeline.n
        timeline = Timeline.from_state(n, state.history, state.skips)
        step = state.step if state.step is not None and timeline.spans else 0
        if not timeline.spans:
            timeline = Timeline(n)
        position = state.consumed if start is None else start
        if skip_steps:
            reading = timeline.spans[-1] if timeline.spans else self.reading
            at = Span(
                step,
                state.epoch,
                position,
                reading.world_size,
                reading.batch_size,
                reading.drop_last,
                reading.uneven,
            )
            for pair in skip_steps:
                first, end = _pair(pair)
                timeline = timeline.with_skip(first, end, at=at)
        self.timeline, self._step, self._first, self._progress = timeline, step, step, None


def _pair(pair: Any) -> tuple[int, int]:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ValueError(f"skip_steps takes (first, end) pairs of steps, got {pair!r}")
    first, end = pair
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (first, end)):
        raise ValueError(f"skip_steps takes (first, end) pairs of integer steps, got {pair!r}")
    return first, end


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) for k, v in fields.items()}
