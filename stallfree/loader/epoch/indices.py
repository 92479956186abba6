"""Where an epoch's indices come from: the only thing the loader's modes differ in.

- :class:`OrderIndices`: our seeded, world-size-independent epoch order (order.py), split into
  equal disjoint rank shares; resumed by global position, on any world size.
- :class:`SamplerIndices`: torch's sampler / batch sampler rules, unchanged; resumed by skipping
  the batches already received (indices only: nothing is read again).

Both feed the same pipeline (plan.py, prefetch.py, workers.py). An ``IterableDataset`` decides
itself what each worker yields, so it runs on torch's own iterator (dataloader.py);
:class:`StreamIndices` only counts it. Each source also carries its resume state
(``resume_point``, ``state_fields``, ``resume_from``), so ``state_dict`` has no mode branch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from stallfree.loader import contracts
from stallfree.loader.epoch import order as order_mod
from stallfree.loader.epoch.progress import EpochProgress
from stallfree.loader.epoch.record import Begin, EpochRecorder, RecordedProgress, RecordWriter
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.epoch.world import World
from stallfree.loader.errors import StateMismatchError


@dataclass(frozen=True)
class EpochIndices:
    """One epoch of one rank: its batches of indices, how many (None: unknown), its progress
    counter, and the base seed its workers get."""

    batches: Iterable[Sequence[Any]]
    total: int | None
    progress: EpochProgress
    base_seed: int


def _derived_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([p & (2**63 - 1) for p in parts]).generate_state(1)[0])


@dataclass(frozen=True)
class OrderIndices:
    """Our order: a pure function of (seed, epoch, dataset length), ranks take equal slices."""

    dataset: Any
    order: str
    seed: int
    world: World
    uneven: str
    window: int
    batch_size: int
    drop_last: bool
    first_window: int | None = None  # block order: a short first window (where windows are staged)
    unit: ClassVar[str] = "positions"

    def reseeded(self, seed: int) -> OrderIndices:
        """The same order under another seed (a drawn seed, or a restored state's)."""
        return replace(self, seed=int(seed))

    def __len__(self) -> int:
        n, w, bs = len(self.dataset), self.world.size, self.batch_size
        share = -(-n // w) if self.uneven == "pad" else n // w  # equal per rank: padded or cut
        return share // bs if self.drop_last else -(-share // bs)

    def epoch_order(self, epoch: int) -> order_mod.Order:
        """The epoch's order as a function (order.py): O(1) memory in the dataset's length."""
        return order_mod.make_order(
            self.seed,
            epoch,
            len(self.dataset),
            mode=self.order,
            shard_sizes=contracts.shard_sizes_of(self.dataset),
            window=self.window,
            first_window=self.first_window,
        )

    def epoch(
        self,
        epoch: int,
        resume_from: int,
        *,
        skipped: tuple[tuple[int, int], ...] = (),
        step: int = 0,
        writer: RecordWriter | None = None,
    ) -> EpochIndices:
        """One epoch of this rank from ``resume_from``, leaving out the ``skipped`` position
        ranges (``skip_steps=``); with a ``writer`` (``record_keys=``) every batch the consumer
        receives is recorded, numbered from ``step``."""
        start = min(resume_from, len(self.dataset))  # a saved end-of-epoch state: nothing left
        w = self.world
        share = order_mod.RankShare(self.epoch_order(epoch), start, w.rank, w.size, self.uneven, skipped)
        plan = order_mod.batches(
            share, self.batch_size, self.drop_last
        )  # each batch computed when dispatched
        samples = plan.samples
        base_seed = _derived_seed(self.seed, epoch, w.rank, 7)
        if writer is None:
            progress = EpochProgress(epoch, self.unit, start=start, planned=samples, samples=samples)
            return EpochIndices(plan, len(plan), progress, base_seed)
        begin = Begin(
            w.rank, w.size, epoch, start, step, len(self.dataset), time.time_ns(),
            self.batch_size, self.uneven, self.drop_last,
        )  # fmt: skip
        recorder = EpochRecorder(writer, share, self.batch_size, begin)
        progress = RecordedProgress(
            epoch, self.unit, start=start, planned=samples, samples=samples,
            recorder=recorder, batch_size=self.batch_size,
        )  # fmt: skip
        return EpochIndices(plan, len(plan), progress, base_seed)

    def consumed(self, progress: EpochProgress, skipped: tuple[tuple[int, int], ...] = ()) -> int:
        """Global position reached once every rank has received what this one has (skipped
        ranges count as consumed when reached)."""
        return order_mod.consumed_after(
            progress.start, progress.received, self.world.size, len(self.dataset), skipped
        )

    # -- resume state: what state_dict saves and load_state_dict restores (no mode branch there)
    resume_point = consumed

    @property
    def identity(self) -> str:
        """The order's layout, as a resume state records it."""
        return order_mod.order_identity(self.order, self.window, self.first_window)

    def state_fields(self, resume: int) -> dict[str, Any]:
        return {"consumed": resume, "dataset_len": len(self.dataset), "batches": 0, "order": self.identity}

    def resume_from(self, state: LoaderState, *, reweighted: bool = False) -> int:
        """Global positions to skip; the saved dataset length must match (unless a mixture was
        explicitly reweighted: its length may change with the weights), and so must the order's
        layout when the epoch is under way (its positions hold other samples under another)."""
        n = len(self.dataset)
        if state.dataset_len != n and not reweighted:
            raise StateMismatchError(
                f"state is for a dataset of {state.dataset_len} samples, this one has {n} (pass "
                "allow_other_dataset=True to load_state_dict to continue on other data on purpose)"
            )
        if not 0 <= state.consumed <= n:
            raise StateMismatchError(
                f"state's position 'consumed' is {state.consumed}, outside this epoch's 0..{n} "
                f"(a dataset of {n} samples)"
            )
        if state.consumed and state.order is not None and state.order != self.identity:
            raise ValueError(
                f"state was saved {state.consumed} positions into an epoch of order {state.order!r}, "
                f"this loader's order is {self.identity!r}: continuing would skip some samples and "
                "repeat others (pass the order=, window= and staging= the state was saved with, or "
                "resume at the next epoch boundary)"
            )
        return state.consumed


class BatchResume:
    """Resume by batches received (torch's sampler, an iterable dataset's stream): the batches
    before are skipped (sampler: indices only; a stream replays and discards)."""

    unit: ClassVar[str] = "batches"

    def reseeded(self, seed: int) -> BatchResume:
        """Unchanged: torch's sampler (or the stream) draws its own randomness."""
        return self

    def resume_point(self, progress: EpochProgress, skipped: tuple[tuple[int, int], ...] = ()) -> int:
        return progress.received

    def state_fields(self, resume: int) -> dict[str, int]:
        return {"consumed": 0, "dataset_len": 0, "batches": resume}

    def resume_from(self, state: LoaderState, *, reweighted: bool = False) -> int:
        """Batches to skip: within the epoch's batches where their number is known."""
        total = self.batches_per_epoch()
        if state.batches < 0 or (total is not None and state.batches > total):
            span = f"0..{total}" if total is not None else ">= 0"
            raise StateMismatchError(
                f"state's position 'batches' is {state.batches}, outside this epoch's {span} batches"
            )
        return state.batches

    def batches_per_epoch(self) -> int | None:
        """Batches in a whole epoch (None: unknown, a stream)."""
        return None


@dataclass(frozen=True)
class StreamIndices(BatchResume):
    """An ``IterableDataset``'s own stream, on torch's iterator: only its progress and resume
    state are ours."""

    def progress(self, epoch: int, resume_from: int) -> EpochProgress:
        return EpochProgress(epoch, self.unit, received=resume_from)


@dataclass(frozen=True)
class SamplerIndices(BatchResume):
    """torch's sampler (or batch sampler), as torch's DataLoader draws from it: ``index_sampler``
    is what torch's iterator draws from (the batch sampler when batching), ``sampler`` what a
    fractional failure budget is a fraction of, ``generator`` the workers' base seed's source."""

    index_sampler: Any
    sampler: Any
    generator: Any
    auto_collation: bool

    def batches_per_epoch(self) -> int | None:
        try:
            return len(self.index_sampler)
        except TypeError:  # a sampler without a length
            return None

    def epoch(self, epoch: int, resume_from: int) -> EpochIndices:
        source: Any = iter(self.index_sampler)
        base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        if not self.auto_collation:
            source = ([i] for i in source)  # one index per task (maybe itself a list: bulk reads)
        if resume_from:
            source = itertools.islice(source, resume_from, None)
        try:
            total: int | None = max(0, len(self.index_sampler) - resume_from)
        except TypeError:
            total = None
        try:
            samples = len(self.sampler)  # what a fractional failure budget is a fraction of
        except TypeError:
            samples = 0
        progress = EpochProgress(epoch, self.unit, received=resume_from, samples=samples)
        return EpochIndices(source, total, progress, base_seed)


IndexSource = OrderIndices | SamplerIndices | StreamIndices
