"""Everything that crosses a process boundary between the loader and its workers, as frozen types.

main -> worker: :class:`Task` on the worker's task queue (``None`` there means "stop"), and slot
numbers (plain ints) on its slot-return channel. worker -> main: :class:`BatchReady` or
:class:`WorkerFailure` on the shared result queue. Adding a field is one edit here plus its uses;
nothing is read back by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One batch for a worker: ``indices`` are read (one "index" per task, maybe a list, when the
    loader does not batch: ``batch_size=None``); ``gen`` tells iterators apart (a persistent pool
    serves several), ``seq`` is the batch's place in the epoch."""

    gen: int
    seq: int
    indices: list[Any]
    decode_seed: int | None = None  # the batch's seed when the workers run the batch decoder
    epoch: int | None = None  # for a dataset with its own epoch order (a mixture): set in the worker
    stage_ahead: tuple[int, ...] = ()  # block order: the next window's shards, staged while this is read


@dataclass(frozen=True)
class FailedSample:
    """A sample skipped under ``on_error`` skip/warn: reported to the main process for stats."""

    index: int
    key: str | None  # the sample's key (None: not known; reported as its index)
    stage: str
    reason: str


@dataclass(frozen=True)
class BatchReady:
    """A finished batch: its tensors lie in shared slot ``slot`` (described by ``payload``), or, with
    ``slot`` None, ``payload`` is the batch itself (nothing array-like, or no shared memory)."""

    gen: int
    seq: int
    worker: int
    slot: int | None
    payload: Any
    good: int  # samples in the batch (after skipped ones)
    new_storage: Any = None  # the slot's storage, sent once when the slot is new or grown
    failures: tuple[FailedSample, ...] = ()
    timing: dict[str, float] = field(default_factory=dict)
    cache_stats: dict[str, float] | None = None
    dropped_slots: tuple[int, ...] = ()  # slots the worker gave up: the main process lets go too
    handover: bool = False  # ``new_storage`` is the consumer's for good (slots.py): never sent back
    indices: tuple[int, ...] = ()  # the good samples' indices, when ``payload`` is raw samples


@dataclass(frozen=True)
class WorkerFailure:
    """A batch that failed: raised in the consumer's ``next()``, and iteration goes on with the next
    batch, as torch's. A worker whose ``worker_init_fn`` raised answers each of its tasks with that
    error. ``error`` is our own exception (travels as itself) or torch's exception wrapper."""

    gen: int
    seq: int
    worker: int
    index: Any
    key: str | None
    error: Any
