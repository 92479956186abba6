"""``stallfree.DataLoader``: torch's DataLoader signature and behaviour, plus a fast path.

Three modes, chosen from the arguments (``loader.mode``):

- ``fast``: a map-style dataset with no sampler and ``shuffle=True`` (or any stallfree sharded
  dataset, or when one of our options such as ``seed=``/``cache=``/``decode=``/``world=`` is
  given): our seeded, world-size-independent epoch order split into equal disjoint rank shares,
  clairvoyant read-ahead, shared-memory slots, exact resume on any world size.
- ``sampler``: any other map-style dataset: torch's sampler / batch sampler / collate rules, run on
  our workers (same read-ahead and slots; errors name the sample; dead or hung workers are errors;
  resume skips indices without reading them).
- ``iterable``: an ``IterableDataset`` runs on torch's own machinery (the dataset decides what each
  worker yields), measured for ``stats()``; resume replays and discards.

The mode, order, decode placement, index source and worker and main plans are decided by
``options.plan`` from a frozen ``LoaderOptions``, once; the index source (``sources.py``) keeps
the resume state.

Several ``iter()`` at once (``a = iter(dl); next(a); b = iter(dl)``) behave as torch's: each
iterator is independent (its own epoch, its own workers), except that with
``persistent_workers=True`` (and workers) the loader has one pool, which the newest iterator
takes over: an older one still mid-epoch then raises ``IteratorSupersededError`` on its next
``next()`` (torch silently resets its one iterator there); likewise a mixture read without
workers (its one epoch setting). ``state_dict()`` describes the most recently created iterator.
"""

from __future__ import annotations

import atexit
import logging
import os
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch
import torch.utils.data as tud

from stallfree.loader import _torch_compat as compat
from stallfree.loader import contracts, fdlimit
from stallfree.loader.assembler import Assembler, failure_budget
from stallfree.loader.epoch.indices import EpochIndices, IndexSource, OrderIndices, StreamIndices
from stallfree.loader.epoch.order import Batches
from stallfree.loader.epoch.progress import EpochProgress
from stallfree.loader.epoch.record import RecordWriter
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.epoch.steps import StepClock
from stallfree.loader.epoch.world import World, resolve_world
from stallfree.loader.errors import IteratorSupersededError, StateMismatchError
from stallfree.loader.iterator import SHARED_EPOCH, SHARED_POOL, LoaderIterator, superseded_message
from stallfree.loader.lead_staging import LeadStaging
from stallfree.loader.options import LoaderOptions, plan
from stallfree.loader.plan import MainPlan, worker_cores
from stallfree.loader.pool import Engine, RemoteWorkers
from stallfree.loader.shm import heap as allocator
from stallfree.loader.stats import LoaderStats

logger = logging.getLogger(__name__)

T_co = TypeVar("T_co", covariant=True)


class DataLoader(tud.DataLoader[T_co]):
    """Drop-in for ``torch.utils.data.DataLoader``; see the module docstring for the three modes.

    Our keyword-only options: ``seed`` (epoch order; default drawn from ``generator`` or torch's
    RNG, and 0 in a multi-rank job as DistributedSampler does), ``cache`` (a stallfree cache: raw
    reads go through it), ``decode`` (object with ``decode_batch``: run in the main process, or
    in the workers when it says ``runs_in_workers`` and accepts ``alloc=``, as ImageDecode's CPU
    decoder does; or a per-sample callable run in workers), ``device`` (copy batches there on a side CUDA stream),
    ``on_error`` (raise|skip|warn), ``max_failures`` (an int is a count; a float in [0, 1] a
    fraction of the rank's epoch: 1.0 lets every sample fail), ``order`` (auto|global|block|sequential), ``world`` (override rank/size), ``uneven`` (pad|drop:
    how ranks equalise an uneven tail), ``window`` (shards per block in block order),
    ``worker_timeout`` (seconds a worker may go without any progress, no batch sent and no step to
    another sample, before it counts as hung; one merely waiting for work is never hung),
    ``decode_threads`` (threads per worker running the per-sample ``decode``; default: the cores
    left per worker, 1 to 4 — PIL-style decoders release the GIL), ``fetch_threads`` (tasks each
    worker reads at once, default 1; more hides remote latency: worth it with a deep prefetch), ``autotune`` (adapt the number
    of batches in flight from queue occupancy and consumer waits, within ``memory_budget`` bytes),
    ``staging`` (None: for block order over remote shards each worker stages whole shards in a
    node-local directory shared by the node's processes and reads samples from there; False:
    off; a directory or a ``stallfree.storage.staging.Staging(root=, cap_bytes=)``), ``record_keys``
    (a directory: each rank appends the epoch positions it delivers to a compact binary log there,
    for ``stallfree audit DIR``; our order only), ``remote`` (a ``stallfree.RayWorkers``:
    remote workers that add capacity beside the local ones, docs/remote_workers.md).

    Iterators: each ``iter()`` gives an independent iterator over the next epoch (its own workers;
    fast, sampler and iterable modes alike), as torch's. With ``persistent_workers=True`` and
    workers there is one pool, and a new ``iter()`` takes it over: an older iterator that is still
    mid-epoch then raises ``IteratorSupersededError`` on its next ``next()`` instead of stopping
    silently (torch resets its one iterator there; its undelivered batches are lost too). So does
    one over a dataset that orders itself (a mixture) with ``num_workers=0``: both would read
    through its one epoch setting. ``state_dict()`` is always the newest iterator's progress.

    Resume: ``state_dict()`` records the dataset's identity (its length, and its fingerprint
    where it has one); ``load_state_dict`` refuses a state from other data, or with a position
    outside the epoch, with a ``StateMismatchError`` (a ValueError) unless
    ``allow_other_dataset=True``; states saved before the identity was recorded still load.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        cache: Any = None,
        decode: Any = None,
        device: Any = None,
        on_error: str = "raise",
        max_failures: int | float | None = None,
        order: str = "auto",
        world: World | Mapping[str, int] | tuple[int, int] | None = None,
        uneven: str = "pad",
        window: int = 8,
        worker_timeout: float | None = 300.0,
        decode_threads: int | None = None,
        fetch_threads: int | None = None,
        autotune: bool = False,
        memory_budget: int = 1 << 30,
        staging: Any = None,
        record_keys: str | os.PathLike[str] | None = None,
        remote: RemoteWorkers | None = None,
    ) -> None:
        if collate_fn is None and batch_size is not None and contracts.orders_itself(dataset):
            collate_fn = contracts.own_collate_of(dataset)  # a mixture batches its sources (mix/collate.py)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self._options = LoaderOptions(
            batch_size=self.batch_size,
            shuffle=shuffle,
            custom_sampler=sampler is not None or batch_sampler is not None,
            num_workers=self.num_workers,
            iterable=isinstance(dataset, tud.IterableDataset),
            drop_last=self.drop_last,
            collate_fn=None if self.collate_fn is tud.default_collate else self.collate_fn,
            auto_collation=compat.auto_collation(self),
            index_sampler=compat.index_sampler(self),
            sampler=self.sampler,
            generator=self.generator,
            worker_init_fn=self.worker_init_fn,
            prefetch_factor=self.prefetch_factor,
            in_order=self.in_order,
            pin_memory=self.pin_memory,
            timeout=self.timeout,
            seed=seed,
            cache=cache,
            decode=decode,
            device=device,
            on_error=on_error,
            max_failures=max_failures,
            order=order,
            world=None if world is None else resolve_world(world),
            uneven=uneven,
            window=window,
            worker_timeout=worker_timeout,
            decode_threads=decode_threads,
            fetch_threads=1 if fetch_threads is None else fetch_threads,
            autotune=bool(autotune),
            memory_budget=int(memory_budget),
            staging=staging,
            record_keys=None if record_keys is None else os.fspath(record_keys),
            job_world=resolve_world(None),
            cuda=torch.cuda.is_available(),
            worker_cores=worker_cores(self.num_workers),
        )
        decided = plan(dataset, self._options)
        if decided.needs_seed:  # drawn only here, so torch's RNG advances as it always did
            decided = decided.with_seed(int(torch.empty((), dtype=torch.int64).random_(generator=generator)))
        self._plan = decided
        if remote is not None and not isinstance(remote, RemoteWorkers):
            raise TypeError(f"remote= takes a stallfree.RayWorkers, got {type(remote).__name__}")
        if remote is not None and decided.mode == "iterable":
            raise ValueError(
                "remote= needs a map-style dataset (an IterableDataset runs on torch's own iterator)"
            )
        self._remote = remote
        self._tuner = None
        self._stats = LoaderStats()
        self._next_epoch = 0
        self._resume_from = 0  # positions (our order) or batches (sampler, iterable) to skip
        # the live iterators, which hold us (not the reverse); the newest one's progress is _progress
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._engine: Engine | None = None
        self._lead: LeadStaging | None = None  # the main process staging a first window
        self._progress: EpochProgress | None = None
        self._clock = self._make_clock()  # steps and the run's timeline (our order only)
        self._record: RecordWriter | None = None  # record_keys=: this process's delivery record
        self._restored_epoch: int | None = None  # load_state_dict's epoch, until iterated or moved off
        _LOADERS.add(self)

    # torch's DataLoader lets these be reassigned after construction (the others raise there);
    # the plan is made once, so reassigning one makes it again, keeping the seed and the index
    # source (and with it any restored resume state). As with torch, persistent workers that are
    # already running keep the plan they were started with.
    _REPLANNED = frozenset({"collate_fn", "worker_init_fn", "pin_memory", "timeout", "prefetch_factor"})

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in self._REPLANNED and "_plan" in self.__dict__:
            self._replan()

    def _replan(self) -> None:
        options = replace(
            self._options,
            collate_fn=None if self.collate_fn is tud.default_collate else self.collate_fn,
            worker_init_fn=self.worker_init_fn,
            pin_memory=self.pin_memory,
            timeout=self.timeout,
            prefetch_factor=self.prefetch_factor,
        )
        decided = plan(self.dataset, options)
        self._options = options
        self._plan = replace(decided, seed=self._plan.seed, source=self._plan.source)

    # -- public API -----------------------------------------------------------------------
    @property
    def seed(self) -> int:
        return int(self._plan.seed or 0)

    @property
    def world(self) -> World:
        return self._plan.world

    @property
    def fast_path(self) -> bool:
        return self._plan.fast

    @property
    def uneven(self) -> str:
        """How ranks equalise an uneven tail of the epoch: ``pad`` or ``drop``."""
        return self._options.uneven

    @property
    def device(self) -> Any:
        """Where batches are copied (``device=``), or None when they stay on the CPU."""
        return self._options.device

    @property
    def mode(self) -> str:
        """``fast`` (our order and rank split), ``sampler`` (a sampler through our workers) or ``iterable``."""
        return self._plan.mode

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of ``epoch`` (also passed on to a sampler with set_epoch).

        The epoch a restored state is in keeps its position: frameworks (transformers' Trainer,
        Lightning, accelerate) call ``set_epoch`` at the top of every epoch, the resumed one
        included, and resetting there would replay the part of it already trained on."""
        epoch = int(epoch)
        if self._restored_epoch != epoch:  # a restored epoch keeps its position until iterated
            self._next_epoch, self._resume_from = epoch, 0
            self._restored_epoch = None
        if not self._plan.fast:
            contracts.set_sampler_epoch(contracts.samplers_of(self.sampler, self.batch_sampler), epoch)

    def __len__(self) -> int:
        if not self._plan.fast:
            return super().__len__()
        return len(self._index_source())

    def __iter__(self) -> Any:
        if self._plan.mode == "iterable":
            return self._generic_iter()
        return self._pipeline_iter()

    def state_dict(self) -> dict[str, Any]:
        """What the consumer has received so far (never what was only prefetched); JSON-safe."""
        p, source = self._progress, self._index_source()
        epoch, resume = self._next_epoch, self._resume_from
        if p is not None:
            epoch, resume = (p.epoch + 1, 0) if p.done else (p.epoch, self._resume_point(p))
        fields = source.state_fields(resume)
        if self._clock is not None:
            fields.update(self._clock.state_fields())
        if self._record is not None:
            self._record.flush()  # the record holds every batch this state counts as received
        if not fields["dataset_len"]:  # torch's sampler, a stream: the length is the identity still
            fields["dataset_len"] = _length_of(self.dataset) or 0
        return LoaderState(
            seed=self.seed,
            epoch=epoch,
            mode=self._plan.mode,
            world_size=self.world.size,
            dataset=contracts.mixture_state(self.dataset),
            fingerprint=contracts.fingerprint_of(self.dataset),
            url=contracts.url_of(self.dataset),
            **fields,
        ).to_dict()

    def load_state_dict(
        self,
        state: Mapping[str, Any],
        *,
        allow_reweight: bool = False,
        allow_other_dataset: bool = False,
        skip_steps: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Continue from ``state`` on the next ``iter()`` (any world size / worker count).

        The state must be this dataset's: a state saved for another length or fingerprint is a
        ``StateMismatchError`` (a ValueError), as is a position outside the epoch.
        ``allow_other_dataset=True`` continues from the saved position on changed data on
        purpose (samples were added or rewritten: the positions now hold other samples); the
        position must still lie inside the epoch. States saved before the identity was recorded
        load unchecked.

        A mixture refuses a state saved for other weights unless ``allow_reweight=True``: the
        explicit choice to go on from the saved position of the *new* order (its earlier positions
        hold other samples than those consumed), never a silent reshuffle.

        ``skip_steps=[(first, end), ...]``: leave out the global batches steps ``first..end-1``
        of the state's run held (known-bad data, a loss spike), on every rank alike; the rest of
        the order is unchanged and the skips are kept in the state (``samples_at`` knows them).
        Steps are the state's numbering (``state["step"]``: batches per rank since the run
        began); step ``first`` of the resumed run is the batch that was step ``end``."""
        st = LoaderState.from_dict(state)
        if skip_steps and self._clock is None:
            raise ValueError("skip_steps= needs our own order (the fast path), not a sampler or a stream")
        mode = self._plan.mode
        if st.mode != mode:
            raise ValueError(f"state was saved by the {st.mode} path but this loader uses the {mode} path")
        reweighted = allow_other_dataset
        if self._plan.ordered and isinstance(self.dataset, contracts.ResumableMixture):
            if st.dataset is None:
                raise ValueError("state has no mixture description; it was saved by another dataset")
            self.dataset.check_state(st.dataset, allow_reweight=allow_reweight)
            reweighted = reweighted or allow_reweight
        elif not allow_other_dataset:
            self._check_identity(st)
        self._resume_from = self._index_source().resume_from(st, reweighted=reweighted)
        if self._clock is not None:
            self._clock.restore(st, skip_steps)
        self._plan = self._plan.with_seed(st.seed)
        self._next_epoch = st.epoch
        self._restored_epoch = st.epoch
        self._progress = None

    def _check_identity(self, st: LoaderState) -> None:
        """The state's dataset must be this one: same length (where both know it) and the same
        fingerprint (where both have one)."""
        hint = "pass allow_other_dataset=True to load_state_dict to continue on other data on purpose"
        n = _length_of(self.dataset)
        if st.dataset_len and n is not None and st.dataset_len != n:
            raise StateMismatchError(
                f"state is for a dataset of {st.dataset_len} samples, this one has {n} ({hint})"
            )
        mine = contracts.fingerprint_of(self.dataset)
        if st.fingerprint is not None and mine is not None and st.fingerprint != mine:
            raise StateMismatchError(
                f"state is for a dataset with fingerprint {st.fingerprint!r}, this one's is {mine!r}: its "
                "content changed, or it is another dataset (a manifest-less copy on another machine has "
                f"other file stamps: write a manifest with `stallfree index` to give copies one identity); {hint}"
            )

    def _mix_stats(self) -> dict[str, Any] | None:
        """Samples delivered per source this epoch (all ranks' positions consumed so far)."""
        counts, p = contracts.mixture_counts(self.dataset), self._progress
        if counts is None or p is None:
            return None
        stop = len(self.dataset) if p.done else self._resume_point(p)
        out = {"epoch": p.epoch, "positions": [p.start, stop], "delivered": counts(p.start, stop)}
        if isinstance(self.dataset, contracts.ReportsShares):  # targets beside achieved fractions
            window = self.world.size * (self.batch_size or 1)
            out["fractions"] = self.dataset.fractions(p.start, stop, window)
        return out

    def _resume_point(self, progress: EpochProgress) -> int:
        """The global position reached (skipped ranges of the epoch stepped over)."""
        skipped = self._clock.skipped(progress.epoch) if self._clock is not None else ()
        return self._index_source().resume_point(progress, skipped)

    def _make_clock(self) -> StepClock | None:
        source = self._plan.source
        if not isinstance(source, OrderIndices):
            return None
        return StepClock(
            len(self.dataset), self.world.size, source.batch_size, source.drop_last, source.uneven
        )

    def samples_at(self, step: int, rank: int | None = None, *, keys: bool = True) -> Any:
        """The samples of step ``step``'s batch on ``rank`` (default: this one), computed from
        the order and the run's timeline, never from a log: a ``StepSamples`` (``epoch/samples.py``)
        naming each sample's position, index and, where the dataset tells, source, shard, key
        or packed documents with token offsets. Past, present or future steps alike (a future
        one as the current world size would read it); after ``load_state_dict`` the restored
        run's steps, skips included. ``keys=False`` leaves out sample keys (a sharded
        dataset reads them from each touched shard's index)."""
        if self._clock is None:
            raise ValueError("samples_at needs our own order (the fast path), not a sampler or a stream")
        from stallfree.loader.epoch.samples import step_samples

        timeline = self._clock.timeline
        if self._progress is None:  # nothing iterated since the start or a restore: the next epoch's span
            timeline = self._clock.preview(self._next_epoch, self._resume_from)
        source = self._index_source()
        assert isinstance(source, OrderIndices)
        rank = self.world.rank if rank is None else rank
        return step_samples(self.dataset, self._order_of, timeline, step, rank, keys=keys)

    def _order_of(self, epoch: int) -> Any:
        """The epoch's order (our order), the last few kept: building one over 200,000 shards
        costs more than a ``samples_at`` lookup."""
        source = self._index_source()
        assert isinstance(source, OrderIndices)
        key = (source.seed, epoch)
        orders = self.__dict__.setdefault("_orders", {})
        if key not in orders:
            if len(orders) >= 4:
                orders.pop(next(iter(orders)))
            orders[key] = source.epoch_order(epoch)
        return orders[key]

    def stats(self) -> dict[str, Any]:
        """Per-rank counters: data wait vs compute, throughput, queue, stage times, cache, decode."""
        out = self._stats.as_dict()
        out.update(
            path=self._plan.mode,
            rank=self.world.rank,
            world_size=self.world.size,
            num_workers=self.num_workers,
            epoch=self._progress.epoch if self._progress is not None else self._next_epoch,
        )
        if self._remote is not None:
            out["remote"] = self._remote.stats()
        mix = self._mix_stats()
        if mix is not None:
            out["mix"] = mix
        if self._tuner is not None:
            out["autotune"] = {
                "depth": self._tuner.depth,
                "batch_bytes": self._tuner.batch_bytes,
                "memory_budget": self._options.memory_budget,
                "history": list(self._tuner.history[-20:]),
            }
        placement = self._plan.decode
        if placement.where != "none" and isinstance(placement.decoder, contracts.ReportsStats):
            out["decode"] = placement.stats()
        if isinstance(out.get("decode"), dict) and placement.batch:
            in_workers = placement.where == "workers"
            out["decode"]["where"] = "workers" if in_workers else "main"
            if in_workers:  # the main process's copy decoded nothing: count here
                decode_s = self._stats.stages.get("decode_batch_s", 0.0)
                out["decode"].update(
                    batches=self._stats.batches,
                    images=self._stats.samples,
                    failures=self._stats.failures,
                    decode_s=decode_s,
                    images_per_s=self._stats.samples / decode_s if decode_s > 0 else 0.0,
                )
        return out

    def close(self) -> None:
        """Stop any workers now (they also stop when the loader is garbage collected)."""
        self._shut(graceful=True)

    def _shut(self, graceful: bool) -> None:
        """End every live iterator, the persistent pool and the lead staging."""
        for it in list(self._live):
            it.close(graceful)
        self._live = weakref.WeakSet()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown(graceful)
        lead, self._lead = self._lead, None
        if lead is not None:
            lead.close()
        record, self._record = self._record, None
        if record is not None:
            record.close()
        if self._remote is not None:
            self._remote.close()

    def _supersede_live(self, why: str) -> None:
        """The new iterator cannot run beside the live ones (``why``): they end, and one still
        mid-epoch says so on its next ``next()`` (never a silent stop)."""
        for it in list(self._live):
            it.supersede(why)

    # -- the pipeline: one plan, two index sources ---------------------------------------------------
    def _index_source(self) -> IndexSource:
        """Where this loader's indices come from, with the resume state it keeps (the plan's;
        ``load_state_dict`` replaces the plan's seed)."""
        assert self._plan.source is not None
        return self._plan.source

    def _engine_for(self, base_seed: int) -> tuple[Engine, bool]:
        """The worker pool for the next iteration, and whether the iterator owns (and ends) it."""
        if self.pin_memory and not torch.cuda.is_available():
            warnings.warn(  # torch's own warning, so scripts see the same thing
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
        if self.persistent_workers and self.num_workers > 0:
            self._supersede_live(SHARED_POOL)
            if self._engine is None or self._engine.closed:
                self._engine = self._new_engine(base_seed)
            return self._engine, False
        return self._new_engine(base_seed), True

    def _new_engine(self, base_seed: int) -> Engine:
        worker = replace(self._plan.worker, base_seed=base_seed)  # the epoch's; the rest is the plan's
        local = Engine(worker, self.num_workers, self.multiprocessing_context)
        if self._remote is None:
            return local
        try:  # the remote workers join this pool (stallfree/engines/ray_pool.py)
            return self._remote.pool(local, worker, self.prefetch_factor or 2, self._plan.main.pin_memory)
        except BaseException:
            local.shutdown(graceful=False)
            raise

    def _pipeline_iter(self) -> LoaderIterator:
        self._restored_epoch = None
        epoch, resume = self._next_epoch, self._resume_from
        self._next_epoch, self._resume_from = epoch + 1, 0
        ep: EpochIndices = self._epoch_indices(epoch, resume)
        if self._plan.ordered:
            if self.num_workers == 0:  # read here, through the one epoch setting the live ones use too
                self._supersede_live(SHARED_EPOCH)
            self.dataset.set_epoch(epoch)  # here too: the main process may read it (num_workers=0)
        allocator.keep_freed_memory()  # before the workers fork: they inherit it
        try:
            engine, owns = self._engine_for(ep.base_seed)
        except OSError as exc:  # pipes, sockets and queues for the workers: none left (kept batches)
            if fdlimit.is_emfile(exc):
                raise fdlimit.too_many_open_files("starting the loader's workers") from exc
            raise
        # before the other workers fork (Assembler): its downloads start ~25 ms sooner. What a
        # fork copies of its threads is safe: the staging flocks are closed in the child
        # (staging_locks.Held), and the dataset, its client and the staging area are renewed per pid
        self._stage_first_window(ep.batches)
        rank, seed = self.world.rank, self.seed

        def decode_seed(seq: int) -> int:
            return int(np.random.SeedSequence([seed & (2**63 - 1), epoch, rank, seq]).generate_state(1)[0])

        try:
            core = Assembler(
                engine,
                ep.batches,
                self._main_plan(ep.progress.samples),
                decode_seed=decode_seed,
                stats=self._stats,
                owns_engine=owns,
                tuner=self._make_tuner(engine.n),
                epoch=epoch if self._plan.ordered else None,
                lead=self._lead,
            )
        except BaseException:
            if owns:
                engine.shutdown(graceful=False)
            raise
        self._progress = ep.progress
        if self._clock is not None:
            self._clock.started(ep.progress)
        it = LoaderIterator(core, ep.progress, self._stats, ep.total, owner=self)
        self._live.add(it)
        return it

    def _epoch_indices(self, epoch: int, resume: int) -> EpochIndices:
        """The epoch's indices; for our order also its first step and skipped ranges, recorded
        with ``record_keys=``."""
        source = self._index_source()
        if self._clock is None or not isinstance(source, OrderIndices):
            return source.epoch(epoch, resume)
        step, skipped = self._clock.starting(epoch, resume)
        directory = self._options.record_keys
        if directory is not None and self._record is None:
            self._record = RecordWriter(directory, self.world.rank)
        return source.epoch(epoch, resume, skipped=skipped, step=step, writer=self._record)

    def _stage_first_window(self, batches: Any) -> None:
        """Block order over remote shards, staged: the main process starts fetching the epoch's
        first window while the workers start, and the next one once it is in
        (``LeadStaging``)."""
        staging = self._plan.worker.staging
        if self._lead is not None:
            self._lead.close()
            self._lead = None
        if staging is None or self.num_workers == 0 or not isinstance(batches, Batches) or len(batches) == 0:
            return
        shards = batches.window_shards_at(0)
        if shards:
            then = batches.shards_after(0)
            self._lead = LeadStaging(self._plan.worker.dataset, staging, shards, then)

    def _main_plan(self, samples: int) -> MainPlan:
        """The plan's main-process value with this epoch's failure budget."""
        o = self._options
        budget = failure_budget(o.max_failures, samples) if o.on_error != "raise" else None
        extra = self._remote.depth_for(self.num_workers) if self._remote is not None else 0  # remote credits
        return replace(self._plan.main, budget=budget, depth=self._plan.main.depth + extra)

    def _make_tuner(self, n_workers: int) -> Any:
        """The depth tuner (kept across epochs so a tuned depth carries over), or None."""
        if not self._options.autotune:
            return None
        from stallfree.loader.autotune import DepthTuner

        if self._tuner is None:
            self._tuner = DepthTuner(
                (self.prefetch_factor or 2) * n_workers,
                min_depth=n_workers,
                max_depth=16 * n_workers,
                memory_budget=self._options.memory_budget,
            )
        return self._tuner

    # -- generic path -------------------------------------------------------------------
    def _generic_iter(self) -> _GenericIter:
        self._restored_epoch = None
        epoch, skip = self._next_epoch, self._resume_from
        self._next_epoch, self._resume_from = epoch + 1, 0
        progress = StreamIndices().progress(epoch, skip)
        self._progress = progress
        if self.persistent_workers and self.num_workers > 0:  # torch resets its one iterator now
            self._supersede_live(SHARED_POOL)
        it = super().__iter__()
        if self.num_workers > 0 and not self.timeout and self._options.worker_timeout:
            compat.set_iterator_timeout(
                it, self._options.worker_timeout
            )  # a hung worker is an error, never a hang
        generic = _GenericIter(it, progress, self._stats, skip, total=_length_of(it))
        self._live.add(generic)
        return generic

    def __del__(self, _log: logging.Logger = logger) -> None:
        """Bounded, silent and safe at interpreter exit: module globals may be None by now (the
        logger is bound as a default), so nothing here may reach one outside a ``try``, and
        nothing is raised or printed (an atexit hook closes live loaders earlier, while modules
        still work: ``_close_all_at_exit``)."""
        try:
            self._shut(graceful=True)
        except BaseException:  # noqa: BLE001 - a finaliser never raises
            try:
                _log.debug("error closing loader", exc_info=True)
            except BaseException:  # noqa: BLE001, S110 - logging itself torn down at exit
                pass


_LOADERS: weakref.WeakSet = weakref.WeakSet()


def _close_all_at_exit() -> None:
    """Close every loader still alive (not closed, never collected) while modules still work: a
    loader's lead staging and iterators closed later, from ``__del__`` during interpreter
    teardown, would reach module globals already set to None. Registered after the engine's own
    exit hook (engine.py is imported first), so it runs before it."""
    for loader in list(_LOADERS):
        try:
            loader._shut(graceful=False)
        except Exception:  # noqa: BLE001 - at exit: the next loader still gets closed
            logger.debug("error closing a loader at exit", exc_info=True)


atexit.register(_close_all_at_exit)


def _length_of(sized: Any) -> int | None:
    """``len(sized)``, or None where it has none (an IterableDataset, usually, or its iterator)."""
    try:
        return len(sized)
    except TypeError:
        return None


class _GenericIter:
    """torch's own iterator, measured (wait/compute) and counted (for state_dict).

    A generic-path resume replays and discards the first ``skip`` batches: correct for any
    deterministic sampler or iterable dataset, but it reads them again (the fast path does not).
    """

    def __init__(
        self, it: Any, progress: EpochProgress, stats: LoaderStats, skip: int, total: int | None = None
    ) -> None:
        self._it = it
        self._progress = progress
        self._stats = stats
        self._total = total
        self._delivered = 0
        self._finished = False
        self._superseded: str | None = None
        stats.iteration_started()
        for _ in range(skip):
            try:
                next(self._it)
            except StopIteration:
                break
            self._delivered += 1  # delivered before the resume: counted as torch's len() counts

    def __iter__(self) -> _GenericIter:
        return self

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)

    def __next__(self) -> Any:
        if self._finished:
            if self._superseded is not None:
                message, self._superseded = self._superseded, None
                raise IteratorSupersededError(message)
            raise StopIteration
        t0 = self._stats.before_next(0)
        try:
            batch = next(self._it)
        except StopIteration:
            self._finished = True
            self._progress.finish()
            self._stats.epochs += 1
            raise
        self._progress.on_batch(1)
        self._delivered += 1
        self._stats.after_next(t0, _batch_len(batch))
        return batch

    def supersede(self, why: str) -> None:
        """A later ``iter()`` resets torch's one persistent iterator under this wrapper: stop, and
        say so on the next ``next()`` (the rest of this epoch is not delivered)."""
        if self._finished:
            return
        self._finished = True
        self._superseded = superseded_message(self._progress, self._delivered, self._total, why)

    def close(self, graceful: bool = True) -> None:
        """Nothing of ours to stop: torch's iterator ends its workers when it is collected."""
        self._finished = True


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return 1
