"""The pool's first batch gets every core.

A worker's batch decoder runs on its share of the cores (``plan.worker_cores``: with 2 workers on
2 cores, one thread each), so the first batch of a fresh pool took one core's time to decode
while the other worker decoded the second batch, which nobody waits for yet. Measured on the
image peer bench (4,000 JPEGs, batch 64, 2 workers on 2 cores), that decode was most of the time
to the first batch and the reason it trailed DALI's, whose threads all work on one batch.

So the worker given the pool's first task decodes it with the threads of every worker (up to the
cores there are), and the other workers hold their first decode until it is done: they still
read their samples meanwhile. Held at most ``HOLD_S``: a lead that fails, dies or is slow only
delays the others' first batch, and never holds the pool. After that first decode every worker
runs on its own share again; nothing changes for later batches or epochs.

Where the main process makes the pool's first batch itself, before any worker forks
(inline_first.py), there is no gate: every worker decodes on its own share from the start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from stallfree.loader import contracts

log = logging.getLogger(__name__)

HOLD_S = 1.0  # the longest the other workers hold their first decode for the lead's


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity mask
        return os.cpu_count() or 1


def lead_threads(threads: int, num_workers: int, cores: int) -> int:
    """Threads for the pool's first decode: every worker's share, no more than the cores."""
    return max(threads, min(cores, threads * num_workers))


class FirstBatchGate:
    """Shared by one pool's workers (made before they fork or spawn): which task is the pool's
    first (set by the engine when it sends it, before the worker can read it) and whether its
    decode is done."""

    def __init__(self, mp_context: Any) -> None:
        self._first_seq = mp_context.RawValue("q", -1)
        self._first_gen = mp_context.RawValue("q", -1)
        self._done = mp_context.Event()

    def mark_sent(self, gen: int, seq: int) -> None:
        """Called by the engine for every task it sends: the first one is the lead's."""
        if self._first_seq.value < 0:
            self._first_gen.value, self._first_seq.value = gen, seq

    def is_lead(self, gen: int, seq: int) -> bool:
        return self._first_seq.value == seq and self._first_gen.value == gen

    def done(self) -> None:
        self._done.set()

    def hold(self) -> bool:
        """Wait for the lead's first decode (at most ``HOLD_S``); whether it finished."""
        return self._done.wait(HOLD_S)


class FirstDecode:
    """One worker's side of the gate: around its first batch decode only."""

    def __init__(
        self,
        gate: FirstBatchGate | None,
        decoder: Any,
        threads: int,
        num_workers: int,
        cores: int | None = None,
    ) -> None:
        cores = available_cores() if cores is None else cores
        self.lead_threads = lead_threads(threads, num_workers, cores)
        useful = isinstance(decoder, contracts.ThreadedDecoder) and self.lead_threads > threads
        self._gate = gate if useful else None
        self._decoder, self._threads = decoder, threads

    @property
    def active(self) -> bool:
        """Whether this worker's first decode is still to come and takes part in the gate."""
        return self._gate is not None

    @contextmanager
    def around(self, gen: int, seq: int) -> Iterator[None]:
        """The lead decodes with ``lead_threads``; every other worker waits for it first."""
        gate, self._gate = self._gate, None  # the first decode only
        if gate is None:
            yield
            return
        if not gate.is_lead(gen, seq):
            if not gate.hold():
                log.debug("the pool's first decode took over %.1f s; decoding batch %d anyway", HOLD_S, seq)
            yield
            return
        self._decoder.use_threads(self.lead_threads)
        try:
            yield
        finally:
            gate.done()
            self._decoder.use_threads(self._threads)

    def task_done(self, gen: int, seq: int) -> None:
        """After every task: a lead whose first task decoded nothing (its samples all failed, a
        worker_init_fn error) lets the others go at once rather than after ``HOLD_S``."""
        gate = self._gate
        if gate is not None and gate.is_lead(gen, seq):
            self._gate = None
            gate.done()
