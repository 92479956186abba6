"""How far the consumer is into the current epoch: what ``state_dict()`` saves.

Counts what the consumer *received* (never what was only prefetched), in the unit its index
source resumes by: index positions for our own order, batches for a sampler or an iterable.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EpochProgress:
    epoch: int
    unit: str  # "positions" (our order: resumed by global position) or "batches" (skipped on resume)
    start: int = 0  # global position the epoch (re)started from (our order)
    received: int = 0  # units received this epoch (batches: including those skipped on resume)
    planned: int | None = None  # units this rank owes this epoch (None: unknown until the end)
    samples: int = 0  # samples this rank reads this epoch: what a fractional failure budget is of
    done: bool = False
    _next_seq: int = 0  # the first batch (in dispatch order) not yet received
    _ahead: dict[int, int] = field(default_factory=dict)  # seq -> positions, received before _next_seq

    def on_batch(self, positions: int, seq: int | None = None) -> None:
        """The consumer received (or was handed the error of) batch ``seq`` of ``positions`` indices.

        Only the unbroken run of batches from the epoch's first counts as received: with
        ``in_order=False`` a batch that overtook an earlier one counts once the earlier one is
        in, so a resume never skips a batch the consumer did not get (it may repeat, at most the
        batches in flight, the ones that overtook)."""
        if seq is None:
            self._count(positions)
        else:
            self._ahead[seq] = positions
            while self._next_seq in self._ahead:
                self._count(self._ahead.pop(self._next_seq))
                self._next_seq += 1
        if self.planned is not None and self.received >= self.planned:
            self.done = True  # everything owed is received: a save now resumes at the next epoch

    def _count(self, positions: int) -> None:
        self.received += 1 if self.unit == "batches" else positions

    def finish(self) -> None:
        self.done = True
