"""How far the consumer is into the current epoch: what ``state_dict()`` saves.

Counts what the consumer *received* (never what was only prefetched), in the unit its index
source resumes by: index positions for our own order, batches for a sampler or an iterable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EpochProgress:
    epoch: int
    unit: str  # "positions" (our order: resumed by global position) or "batches" (skipped on resume)
    start: int = 0  # global position the epoch (re)started from (our order)
    received: int = 0  # units received this epoch (batches: including those skipped on resume)
    planned: int | None = None  # units this rank owes this epoch (None: unknown until the end)
    samples: int = 0  # samples this rank reads this epoch: what a fractional failure budget is of
    done: bool = False

    def on_batch(self, positions: int) -> None:
        """The consumer received (or was handed the error of) one batch of ``positions`` indices."""
        self.received += 1 if self.unit == "batches" else positions
        if self.planned is not None and self.received >= self.planned:
            self.done = True  # everything owed is received: a save now resumes at the next epoch

    def finish(self) -> None:
        self.done = True
