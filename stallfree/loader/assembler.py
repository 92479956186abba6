"""The main process's half of one epoch: the assembler thread.

It dispatches each batch's indices to a worker ahead of need (credits: one back per batch the
consumer takes), takes finished batches from the workers, materialises them out of their shared
slots (pinned when asked), runs a main-process batch decoder, starts the copy to ``device`` on a
side CUDA stream, and queues them, in order, for the consumer (iterator.py). Dead or silent workers
become errors naming the worker and the sample; nothing waits forever.

The assembler never references the consumer's iterator: dropping the iterator (``break``,
``next(iter(loader))``) is what stops the thread and the workers (iterator.py's finaliser).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stallfree.errors import BatchDecodeError
from stallfree.loader.autotune import DepthTuner
from stallfree.loader.epoch.order import Batches
from stallfree.loader.errors import FailureBudgetExceeded, LoaderError, WorkerDiedError, WorkerHungError
from stallfree.loader.messages import BatchReady, FailedSample, Task, WorkerFailure
from stallfree.loader.plan import MainPlan
from stallfree.loader.pool import Engine
from stallfree.loader.shm import storage as shm
from stallfree.loader.stats import LoaderStats
from stallfree.loader.worker import stages as pipeline

if TYPE_CHECKING:
    from stallfree.loader.lead_staging import LeadStaging

logger = logging.getLogger(__name__)

_POLL_S = 0.1


# -- what the consumer is handed (in-process, typed all the same) ------------------------------
@dataclass(frozen=True)
class Ready:
    batch: Any
    positions: int  # index positions the batch stands for (skipped samples included)
    seq: int
    samples: int
    event: Any = None  # CUDA event the consumer's stream waits on (device copies)


@dataclass(frozen=True)
class Skipped:
    """Every sample of the batch failed under on_error skip/warn: nothing to hand over."""

    positions: int
    seq: int


@dataclass(frozen=True)
class Failed:
    """A batch's error, raised in the consumer's ``next()``. ``fatal``: the epoch cannot go on
    (a dead or hung worker, the failure budget); otherwise iteration goes on, as torch's does."""

    error: Any  # an exception, or torch's exception wrapper (``.reraise()``)
    positions: int = 0
    seq: int | None = None
    fatal: bool = False


@dataclass(frozen=True)
class End:
    pass


Item = Ready | Skipped | Failed | End


class Assembler:
    """Dispatch, assembly and hand-over for one epoch of one rank (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        batches: Iterable[Sequence[Any]],
        plan: MainPlan,
        *,
        decode_seed: Callable[[int], int],
        stats: LoaderStats,
        epoch: int | None = None,
        owns_engine: bool,
        tuner: DepthTuner | None = None,
        lead: LeadStaging | None = None,
    ) -> None:
        self.engine = engine
        self.plan = plan
        self.tuner = tuner
        self.decode_seed = decode_seed
        self.epoch = epoch  # sent with each task for a dataset that orders itself (a mixture)
        self.stats = stats
        self.owns_engine = owns_engine
        engine.gen += 1
        self.gen = engine.gen
        self._source = iter(batches)
        # block order: the next window's shards are staged ahead, by ``lead`` (the main process)
        # where it stages, else by the worker each task names them to
        self._shards_after = batches.shards_after if isinstance(batches, Batches) else None
        self._lead = lead
        self._sizes: dict[int, int] = {}  # seq -> positions, for batches not yet handed over
        self._ahead: list[Any] | None = None
        self._exhausted = False
        self._dispatched = 0
        self._cycle = itertools.cycle(range(engine.n))
        self.out_q: queue.Queue[Item] = queue.Queue()
        depth = tuner.depth if tuner is not None else plan.depth
        stats.queue_capacity = depth
        self._credits = depth
        self._lock = threading.Lock()
        self.outstanding = [0] * engine.n
        self.stop = threading.Event()
        self.closed = False
        self._failures: list[tuple[Any, str, str]] = []
        self._marks: dict[int, tuple[int, ...]] = {}  # each worker's progress slots, last looked at
        self._pull()
        self._dispatch()  # the first worker's first tasks, before the other workers fork
        engine.start_rest()
        self.stream = (
            torch.cuda.Stream(device=plan.device)
            if plan.device is not None and plan.device.type == "cuda"
            else None
        )
        self.thread = threading.Thread(target=self._run, daemon=True, name="stallfree-assembler")
        self.thread.start()

    # -- called from the consumer's thread ---------------------------------------------------------
    def take(self) -> Item:
        """The next item for the consumer; a timeout (torch's ``timeout``) is a Failed item."""
        start = time.monotonic()
        timeout = self.plan.timeout
        while True:
            try:
                return self.out_q.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.thread.is_alive() and self.out_q.empty():
                    return Failed(
                        LoaderError("the loader's assembler thread stopped unexpectedly"), fatal=True
                    )
                if timeout and time.monotonic() - start > timeout:
                    # torch's message; what each worker was doing goes into a note (shown with the
                    # traceback, not part of the message scripts match against)
                    err = RuntimeError(f"DataLoader timed out after {timeout} seconds")
                    if sys.version_info >= (3, 11):  # exception notes are 3.11's
                        err.add_note(f"stallfree: {self._waiting_on()}")
                    return Failed(err)

    def taken(self, waited_s: float, occupancy: int) -> None:
        """The consumer took a batch: its credit comes back (the tuner may add or keep some)."""
        credit = 1
        if self.tuner is not None:
            credit += self.tuner.observe(occupancy, waited_s)
            self.stats.queue_capacity = self.tuner.depth
        self._dispatch(credit)

    def close(self, graceful: bool = True) -> None:
        """Stop the thread (and the workers when this epoch owns them). Bounded, never raises;
        safe from finalisers and from any thread, the assembler's own included."""
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5.0)
        if self.owns_engine or not graceful:  # a persistent pool after a failure: start afresh
            self.engine.shutdown(graceful)

    # -- dispatch ----------------------------------------------------------------------------------
    def _pull(self) -> None:
        """Read the next batch of indices one ahead, so the end of the epoch is known at once."""
        try:
            self._ahead = [pipeline.as_index(i) for i in next(self._source)]
        except StopIteration:
            self._ahead, self._exhausted = None, True

    def _next_worker(self) -> int | None:
        """torch's rule: round robin in order; with in_order=False the next worker (cyclically)
        with fewer than prefetch_factor tasks outstanding, so a worker stuck on a slow sample gets no
        more work while the others are free (None: every worker is full)."""
        if self.engine.remote_depth:  # local and remote workers: the pool picks (local ones first)
            return self.engine.pick()
        n = self.engine.n
        if self.plan.in_order:
            return self._dispatched % n
        cap = max(1, self.plan.prefetch_factor)
        for _ in range(n):
            w = next(self._cycle)
            if self.outstanding[w] < cap:
                return w
        return None

    def _dispatch(self, credit: int = 0) -> None:
        """Send tasks while credit lasts (a credit comes back when the consumer takes a batch)."""
        with self._lock:
            self._credits += credit
            while self._credits > 0 and self._ahead is not None and not self.stop.is_set():
                w = self._next_worker()
                if w is None:
                    return
                seq, indices = self._dispatched, self._ahead
                self._sizes[seq] = len(indices)
                seed = self.decode_seed(seq) if self.plan.worker_decode else None
                ahead = self._shards_after(seq) if self._shards_after is not None else ()
                if ahead and self._lead is not None and self._lead.ahead(ahead):
                    ahead = ()  # the main process stages it: the worker need not
                self.engine.send(w, Task(self.gen, seq, indices, seed, self.epoch, ahead))
                self.outstanding[w] += 1
                self._dispatched += 1
                self._credits -= 1
                self._pull()

    def _done(self, emitted: int) -> bool:
        with self._lock:
            return self._exhausted and emitted == self._dispatched

    def _waiting_on(self) -> str:
        return "; ".join(f"worker {wid} {self.engine.doing(wid)}" for wid in range(self.engine.n))

    # -- the thread --------------------------------------------------------------------------------
    def _put(self, item: Item) -> None:
        """Queue an item for the consumer. ``out_q`` needs no bound of its own: dispatch credits
        (one back per batch taken) already cap what is in flight, so this never blocks."""
        if not self.stop.is_set():
            self.out_q.put(item)

    def _run(self) -> None:
        try:
            self._assemble()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, ends the epoch
            self._put(Failed(exc, fatal=True))

    def _assemble(self) -> None:
        eng = self.engine
        last_seen = [time.monotonic()] * eng.n
        pending: dict[int, Item] = {}
        next_emit = 0
        self._dispatch()
        while not self._done(next_emit):
            if self.stop.is_set():
                return
            try:
                msg = eng.result(_POLL_S)
            except queue.Empty:
                self._check_workers(last_seen)
                continue
            except (ConnectionError, EOFError, OSError):
                # a slot's file descriptor comes from its worker: if that worker died mid-send, say so
                time.sleep(_POLL_S)
                self._check_workers(last_seen)
                raise
            if isinstance(msg, BatchReady):
                for k in msg.dropped_slots:  # slots the worker gave up: let go of our reference too
                    eng.storages.pop((msg.worker, k), None)
            if msg.gen != self.gen:  # left over from an earlier iterator over a persistent pool
                if isinstance(msg, BatchReady) and msg.slot is not None and not msg.handover:
                    self._adopt(msg)
                    eng.returns[msg.worker].send(msg.slot)
                elif isinstance(msg, BatchReady):
                    eng.discard_segment(msg.worker, msg.new_storage)
                continue
            last_seen[msg.worker] = time.monotonic()
            with self._lock:
                self.outstanding[eng.charged_to(msg)] -= 1
            if eng.remote_depth:  # a worker has room again: credit the pool could not place goes now
                self._dispatch()
            if isinstance(msg, WorkerFailure):
                item: Item = Failed(msg.error, self._sizes.pop(msg.seq), msg.seq)
            else:
                item = self._assemble_one(msg)
            pending[msg.seq] = item
            item = None  # the consumer's drop must be the last reference: it hands the slot back
            if not self.plan.in_order:
                for s in list(pending):
                    self._put(pending.pop(s))
                    next_emit += 1
                continue
            while next_emit in pending:
                self._put(pending.pop(next_emit))
                next_emit += 1
        self._put(End())

    def _assemble_one(self, msg: BatchReady) -> Item:
        """A worker's batch, ready for the consumer: materialised, decoded, on its device."""
        t0 = time.perf_counter()
        positions = self._sizes.pop(msg.seq)
        if msg.slot is not None:
            storage = self._adopt(msg)
            release = _keep if msg.handover else _releaser(self.engine, msg, storage)
            batch = shm.materialise(msg.payload, storage, pin=self.plan.pin_memory, release=release)
            if self.tuner is not None:
                self.tuner.saw_batch_bytes(shm.described_bytes(msg.payload))
        else:
            batch = msg.payload
        self.stats.add_stages(dict(msg.timing, transfer_s=time.perf_counter() - t0))
        if msg.cache_stats is not None:
            self.stats.add_cache(msg.cache_stats, msg.worker)
        self._count_failures(msg.failures)
        good = msg.good
        if self.plan.decode_batch is not None and good:
            try:
                batch, good = self._decode(msg.seq, batch, list(msg.indices) or [-1] * good)
            except BatchDecodeError as exc:  # on_error="raise": this batch raises, the epoch goes on
                return Failed(exc, positions, msg.seq)
        if not good:
            return Skipped(positions, msg.seq)
        event = None
        if self.plan.device is not None:
            batch, event = self._to_device(batch)
        elif self.plan.finish is not None:
            batch = self._finish(batch)
        return Ready(batch, positions, msg.seq, good, event)

    def _adopt(self, msg: BatchReady) -> torch.UntypedStorage:
        new_storage = self.engine.storage_of(msg.worker, msg.new_storage)
        if msg.handover:  # the batch's own segment: the consumer's tensors are its only holders
            return new_storage
        key = (msg.worker, msg.slot)
        if new_storage is not None:
            self.engine.storages[key] = new_storage
        return self.engine.storages[key]

    def _count_failures(self, fails: Sequence[FailedSample]) -> None:
        for f in fails:
            self._failures.append((f.index, pipeline.key_or_index(f.index, f.key), f"{f.stage}: {f.reason}"))
            self.stats.failures += 1
            self.stats.failed.append((f.index, pipeline.key_or_index(f.index, f.key), f.reason))
            if self.plan.on_error == "warn":
                logger.warning(
                    "skipping %s: %s failed: %s", pipeline.sample_label(f.index, f.key), f.stage, f.reason
                )
        budget = self.plan.budget
        if budget is not None and len(self._failures) > budget:
            raise FailureBudgetExceeded(
                f"{len(self._failures)} samples failed, more than max_failures allows ({budget})",
                self._failures,
            )

    def _decode(self, seq: int, samples: list[Any], indices: list[Any]) -> tuple[Any, int]:
        """The main-process batch decoder over a batch of raw samples (skip-and-redecode shared
        with the workers: pipeline.decode_dropping_failures)."""
        t0 = time.perf_counter()
        try:
            outcome = pipeline.decode_dropping_failures(
                lambda s: self.plan.decode_batch.decode_batch(s, seed=self.decode_seed(seq)),
                samples,
                indices,
                self.plan.on_error,
            )
            self._count_failures(
                [
                    FailedSample(f.index, f.key, f.stage, f"{type(f.cause).__name__}: {f.cause}")
                    for f in outcome.failures
                ]
            )
            out = outcome.batch
            if out is not None and self.plan.pin_memory:
                out = _pin(out)
            return out, len(outcome.samples)
        finally:
            self.stats.add_stages({"decode_batch_s": time.perf_counter() - t0})

    def _to_device(self, batch: Any) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        device, event = self.plan.device, None
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                batch = _to_device(batch, device, non_blocking=True)
                if self.plan.finish is not None:  # on the copy stream: ordered after the copy
                    batch = self.plan.finish(batch)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            batch = _to_device(batch, device, non_blocking=False)
            if self.plan.finish is not None:
                batch = self.plan.finish(batch)
        self.stats.add_stages({"device_s": time.perf_counter() - t0})
        return batch, event

    def _finish(self, batch: Any) -> Any:
        """The decoder's last step where there is no device copy (uint8 -> float, on the CPU)."""
        t0 = time.perf_counter()
        batch = self.plan.finish(batch)
        self.stats.add_stages({"finish_s": time.perf_counter() - t0})
        return batch

    def _check_workers(self, last_seen: list[float]) -> None:
        """Dead workers owing batches, and hung ones, are errors. Hung means no progress at all:
        no batch sent and no step on to another sample or batch (the worker's progress slots) for
        ``worker_timeout``; a worker busy with a long batch of slow samples is not hung."""
        eng, outstanding = self.engine, self.outstanding
        now = time.monotonic()
        limit = self.plan.worker_timeout
        for wid in range(eng.n):
            mark = eng.progress_mark(wid)
            if mark != self._marks.get(wid):
                self._marks[wid] = mark
                last_seen[wid] = now
            dead, code = eng.dead(wid)
            if dead and outstanding[wid] > 0:
                raise WorkerDiedError(
                    f"DataLoader worker (pid {eng.pid(wid)}) exited unexpectedly: worker {wid}, exit code {code}, "
                    f"{eng.doing(wid)}; {outstanding[wid]} batch(es) outstanding"
                )
            if limit and outstanding[wid] > 0 and now - last_seen[wid] > limit:
                raise WorkerHungError(
                    f"DataLoader worker {wid} (pid {eng.pid(wid)}) made no progress for {limit:.1f} s "
                    f"{eng.doing(wid)}"
                )


def _releaser(engine: Engine, msg: BatchReady, storage: torch.UntypedStorage) -> Callable[[], None]:
    """Runs when the consumer has dropped the batch's last tensor (any thread, maybe at exit):
    never blocks, never raises (returns.SlotReturns)."""
    returns, slot = engine.returns[msg.worker], msg.slot
    release_pages = shm.release_pages

    def release() -> None:
        release_pages(storage)  # the consumer is done: only the worker's refill maps them again
        returns.send(slot)

    return release


def _keep() -> None:
    """The release of a handover slot's batch: nothing goes back (the segment is the consumer's and
    is freed with the batch's last tensor); the lease only keeps the segment mapped till then."""


def _to_device(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    return shm.map_leaves(obj, torch.Tensor, lambda t: t.to(device, non_blocking=non_blocking))


def _pin(obj: Any) -> Any:
    """Pinned copies of the CPU tensors in a batch (a GPU decoder's output is left as it is)."""
    return shm.map_leaves(obj, torch.Tensor, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


def record_stream(obj: Any, stream: Any) -> None:
    """Tell the caching allocator that the consumer's stream uses these tensors, so their memory is
    not handed back to our side stream (and overwritten by the next copy) while still in use."""

    def record(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cuda":
            t.record_stream(stream)
        return t

    shm.map_leaves(obj, torch.Tensor, record)


def failure_budget(max_failures: int | float | None, rank_samples: int) -> int | None:
    """The number of failures allowed this epoch. An int is a count; a float in [0, 1] is a
    fraction of the rank's share, so ``1.0`` allows every sample to fail (it once meant one
    sample: a float 1.0 fell through to the count branch)."""
    check_max_failures(max_failures)
    if max_failures is None:
        return None
    if isinstance(max_failures, float):
        return math.floor(max_failures * rank_samples)
    return int(max_failures)


def check_max_failures(max_failures: Any) -> None:
    """``max_failures``: None, an int count >= 0, or a float fraction in [0, 1]."""
    if max_failures is None:
        return
    if isinstance(max_failures, bool) or not isinstance(max_failures, (int, float)):
        raise TypeError(f"max_failures must be an int count or a float fraction, got {max_failures!r}")
    if isinstance(max_failures, float) and not 0.0 <= max_failures <= 1.0:
        raise ValueError(
            f"max_failures={max_failures!r}: a float is a fraction of the epoch, in [0, 1]; "
            "give a count as an int"
        )
    if max_failures < 0:
        raise ValueError(f"max_failures must be >= 0, got {max_failures}")
