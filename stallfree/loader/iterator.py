"""The iterator a training loop holds: takes ready batches from the assembler (prefetch.py) and
counts what the consumer received. The time ``__next__`` blocks is the data wait.

It owns its assembler but the assembler never refers back to it, so dropping the iterator (an
early ``break``, ``next(iter(loader))``, an exception unwinding the loop) finalises it at once: the
assembler thread stops and the epoch's workers exit, as with torch's DataLoader.

Several iterators of one loader may be alive at once (each with its own workers, as torch's);
only a loader with persistent workers has one pool, and a new iterator takes it over: the older
one is then *superseded* and its next ``next()`` says so (``IteratorSupersededError``) rather than
stopping as if its epoch had ended.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from stallfree.loader import _torch_compat as compat
from stallfree.loader.assembler import Assembler, End, Failed, Ready, Skipped, record_stream
from stallfree.loader.epoch.progress import EpochProgress
from stallfree.loader.errors import IteratorSupersededError
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
        self._delivered = 0  # batches handed to the consumer
        self._superseded: str | None = None  # why a later iter() ended this one (raised once)
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
            if self._superseded is not None:
                message, self._superseded = self._superseded, None
                raise IteratorSupersededError(message)
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
                self._delivered += 1
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

    def supersede(self, why: str) -> None:
        """A later ``iter()`` ends this iterator (``why``: see ``SHARED_POOL``): stop now, and make
        the consumer's next ``next()`` say so, unless everything was already received."""
        if self._finished:
            return
        self._superseded = superseded_message(self._progress, self._delivered, self._total, why)
        self.close()

    def close(self, graceful: bool = True) -> None:
        """Stop now (the epoch's workers exit unless they are the loader's persistent ones)."""
        if self._finished:
            return
        self._finished = True
        self._finalizer.detach()
        self._core.close(graceful)


# why a later iter() ends an older iterator of the same loader (IteratorSupersededError)
SHARED_POOL = (
    "with persistent_workers=True the loader has one worker pool and the new iterator took it over "
    "(torch's DataLoader resets its one iterator there); finish or drop an iterator before starting "
    "the next, or use persistent_workers=False for independent iterators"
)
SHARED_EPOCH = (
    "with num_workers=0 the iterators of a dataset that orders itself (a mixture) read through its "
    "one epoch setting, so two at once would read each other's epochs; finish or drop an iterator "
    "before starting the next, or use num_workers >= 1 for independent iterators"
)


def superseded_message(progress: EpochProgress, delivered: int, total: int | None, why: str) -> str | None:
    """What an iterator ended by a later ``iter()`` says on its next ``next()``; None when it had
    received everything (then it just ends)."""
    if progress.done or (total is not None and delivered >= total):
        return None
    of = f" of {total}" if total is not None else ""
    return (
        f"this iterator was ended by a later iter() on the same DataLoader after {delivered}{of} "
        f"batch(es) of epoch {progress.epoch}: {why}"
    )


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
