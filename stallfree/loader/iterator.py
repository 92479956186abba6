"""The iterator a training loop holds: takes ready batches from the assembler (prefetch.py) and
counts what the consumer received. The time ``__next__`` blocks is the data wait.

It owns its assembler but the assembler never refers back to it, so dropping the iterator (an
early ``break``, ``next(iter(loader))``, an exception unwinding the loop) finalises it at once: the
assembler thread stops and the epoch's workers exit, as with torch's DataLoader.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from stallfree.loader import _torch_compat as compat
from stallfree.loader.prefetch import Assembler, End, Failed, Ready, Skipped, record_stream
from stallfree.loader.progress import EpochProgress
from stallfree.loader.stats import LoaderStats


class LoaderIterator:
    """One epoch of one rank: yields batches (in order unless ``in_order=False``)."""

    def __init__(
        self, core: Assembler, progress: EpochProgress, stats: LoaderStats, total: int | None, owner: Any
    ) -> None:
        self._core = core
        self._progress = progress
        self._stats = stats
        self._total = total
        self._finished = False
        self.owner = owner  # the loader lives as long as any iterator of it
        self._finalizer = weakref.finalize(self, core.close, False)
        stats.iteration_started()

    def __iter__(self) -> LoaderIterator:
        return self

    def __len__(self) -> int:
        if self._total is None:
            raise TypeError("this loader's sampler has no length")
        return self._total

    @property
    def _workers(self) -> list[Any]:
        """The worker processes, as torch's iterator names them (user code reads their pids)."""
        eng = self._core.engine
        return [] if eng.in_process else list(eng.procs)

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        core = self._core
        while True:
            occupancy = core.out_q.qsize()
            t0 = self._stats.before_next(occupancy)
            item = core.take()
            if isinstance(item, Ready):
                if item.event is not None:
                    current = torch.cuda.current_stream(core.plan.device)
                    current.wait_event(item.event)
                    record_stream(item.batch, current)  # made on our side stream, used on theirs
                self._progress.on_batch(item.positions, item.seq)
                core.taken(_elapsed(t0), occupancy)
                self._stats.after_next(t0, item.samples)
                return item.batch
            if isinstance(item, Skipped):
                self._progress.on_batch(item.positions, item.seq)
                core.taken(0.0, occupancy)
                continue
            if isinstance(item, End):
                self.close()
                self._stats.epochs += 1
                self._progress.finish()
                raise StopIteration
            if not isinstance(item, Failed):
                raise TypeError(f"unexpected item from the assembler: {item!r}")
            if item.fatal:
                self.close(graceful=False)
            else:  # this batch failed; the epoch goes on with the next one, as torch's does
                self._progress.on_batch(item.positions, item.seq)
                core.taken(0.0, occupancy)
            _raise(item.error)

    def close(self, graceful: bool = True) -> None:
        """Stop now (the epoch's workers exit unless they are the loader's persistent ones)."""
        if self._finished:
            return
        self._finished = True
        self._finalizer.detach()
        self._core.close(graceful)


def _elapsed(t0: float) -> float:
    return time.perf_counter() - t0


def _raise(error: Any) -> None:
    """A worker's error: our own exceptions travel as themselves (a BatchDecodeError keeps its
    type and failures), anything else in torch's exception wrapper (type and worker traceback)."""
    if isinstance(error, BaseException):
        raise error
    if compat.is_exception_wrapper(error):
        error.reraise()
    raise RuntimeError(f"DataLoader worker failed: {error!r}")
