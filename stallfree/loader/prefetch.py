"""Main-process side of our workers: one epoch's iterator (:class:`FastIterator`) over a pool
(:class:`~stallfree.loader.engine.Engine`).

An assembler thread dispatches each rank batch to its worker ahead of need, copies finished
batches out of their shared slots (pinned when asked), runs ``decode_batch`` when given, starts
the copy to ``device`` on a side CUDA stream, and keeps a bounded queue of ready batches. The
consumer's ``__next__`` only takes from that queue, so the time it blocks is the data wait.
Dead or silent workers become errors naming the worker and the sample; nothing waits forever.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from stallfree.loader import shm
from stallfree.loader.autotune import DepthTuner
from stallfree.loader.engine import Engine
from stallfree.loader.errors import FailureBudgetExceeded, LoaderError, WorkerDiedError, WorkerHungError
from stallfree.loader.stats import LoaderStats
from stallfree.shards.errors import BatchDecodeError

logger = logging.getLogger(__name__)

_POLL_S = 0.1


class FastIterator:
    """One epoch of one rank: yields batches in order; tracks what the consumer received."""

    def __init__(
        self,
        engine: Engine,
        batches: Iterable[Sequence[int]],
        *,
        total: int | None = None,
        prefetch_factor: int,
        in_order: bool,
        pin_memory: bool,
        device: torch.device | None,
        decode_batch: Any,
        decode_seed: Callable[[int], int],
        worker_decode: bool = False,
        on_error: str,
        budget: int | None,
        timeout: float,
        worker_timeout: float | None,
        stats: LoaderStats,
        on_batch: Callable[[int], None],
        on_end: Callable[[], None],
        owns_engine: bool,
        tuner: DepthTuner | None = None,
    ) -> None:
        self.engine = engine
        self.tuner = tuner
        engine.gen += 1
        self.gen = engine.gen
        self._source = iter(batches)
        self._total = total
        self._sizes: dict[int, int] = {}  # seq -> samples planned, for batches not yet handed over
        self._ahead: list[int] | None = None
        self._exhausted = False
        self._dispatched = 0
        self.pf = prefetch_factor
        self.in_order = in_order
        self.pin = pin_memory
        self.device = device
        self.decode_batch = decode_batch
        self.decode_seed = decode_seed
        self.worker_decode = worker_decode  # the workers run the batch decoder: tasks carry its seed
        self.on_error = on_error
        self.budget = budget
        self.timeout = timeout
        self.worker_timeout = worker_timeout
        self.stats = stats
        self.on_batch = on_batch
        self.on_end = on_end
        self.owns_engine = owns_engine
        # like torch: at most prefetch_factor x workers batches between dispatch and the consumer
        depth = tuner.depth if tuner is not None else max(1, prefetch_factor) * engine.n
        self.out_q: queue.Queue = queue.Queue()
        stats.queue_capacity = depth
        self._credits = depth
        self._lock = threading.Lock()
        self._pull()
        self.outstanding = [0] * engine.n
        self.stop = threading.Event()
        self.finished = False
        self.stream = (
            torch.cuda.Stream(device=device) if device is not None and device.type == "cuda" else None
        )
        stats.iteration_started()
        self.thread = threading.Thread(target=self._run, daemon=True, name="stallfree-assembler")
        self.thread.start()

    # -- consumer side -------------------------------------------------------------------
    def __iter__(self) -> FastIterator:
        return self

    def __len__(self) -> int:
        if self._total is None:
            raise TypeError("this loader's sampler has no length")
        return self._total

    def __next__(self) -> Any:
        if self.finished:
            raise StopIteration
        while True:
            occupancy = self.out_q.qsize()
            t0 = self.stats.before_next(occupancy)
            item = self._get()
            kind = item[0]
            if kind == "batch":
                _, batch, positions, samples, event = item
                if event is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    _record_stream(batch, current)  # made on our side stream, used on theirs
                self.on_batch(positions)
                credit = 1
                if self.tuner is not None:
                    delta = self.tuner.observe(occupancy, time.perf_counter() - t0)
                    credit += delta
                    self.stats.queue_capacity = self.tuner.depth
                self._dispatch(credit=credit)
                self.stats.after_next(t0, samples)
                return batch
            if kind == "skip":
                self.on_batch(item[1])
                self._dispatch(credit=1)
                continue
            self.close(graceful=kind == "end")
            if kind == "end":
                self.stats.epochs += 1
                self.on_end()
                raise StopIteration
            raise item[1]

    def _get(self) -> tuple:
        start = time.monotonic()
        while True:
            try:
                return self.out_q.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.thread.is_alive() and self.out_q.empty():
                    return ("error", LoaderError("the loader's assembler thread stopped unexpectedly"))
                if self.timeout and time.monotonic() - start > self.timeout:
                    return (
                        "error",
                        RuntimeError(
                            f"DataLoader timed out after {self.timeout} seconds ({self._waiting_on()})"
                        ),
                    )

    def _pull(self) -> None:
        """Read the next batch of indices one ahead, so the end of the epoch is known at once."""
        try:
            self._ahead = [int(i) for i in next(self._source)]
        except StopIteration:
            self._ahead, self._exhausted = None, True

    def _dispatch(self, credit: int = 0) -> None:
        """Send tasks while credit lasts (a credit comes back when the consumer takes a batch)."""
        eng = self.engine
        with self._lock:
            self._credits += credit
            while self._credits > 0 and self._ahead is not None and not self.stop.is_set():
                seq, indices = self._dispatched, self._ahead
                w = seq % eng.n
                self._sizes[seq] = len(indices)
                seed = self.decode_seed(seq) if self.worker_decode else None
                eng.task_qs[w].put((self.gen, seq, indices, seed))
                self.outstanding[w] += 1
                self._dispatched += 1
                self._credits -= 1
                self._pull()

    def _done(self, emitted: int) -> bool:
        with self._lock:
            return self._exhausted and emitted == self._dispatched

    def _waiting_on(self) -> str:
        return "; ".join(f"worker {wid} {self.engine.doing(wid)}" for wid in range(self.engine.n))

    def close(self, graceful: bool = True) -> None:
        if self.finished:
            return
        self.finished = True
        self.stop.set()
        self.thread.join(timeout=5.0)
        if self.owns_engine:
            self.engine.shutdown(graceful)
        elif not graceful:  # a persistent pool after a worker failure: start afresh next epoch
            self.engine.shutdown(False)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
            logger.debug("error closing iterator", exc_info=True)

    # -- assembler thread ----------------------------------------------------------------
    def _put(self, item: tuple) -> bool:
        """Queue an item for the consumer. ``out_q`` needs no bound of its own: dispatch credits
        (one back per batch taken) already cap what is in flight, so this never blocks."""
        if self.stop.is_set():
            return False
        self.out_q.put(item)
        return True

    def _run(self) -> None:
        try:
            self._assemble()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(("error", exc))

    def _assemble(self) -> None:
        eng = self.engine
        outstanding = self.outstanding
        last_seen = [time.monotonic()] * eng.n
        pending: dict[int, tuple] = {}
        next_emit = 0
        failures: list[tuple[int, str, str]] = []
        self._dispatch()
        while not self._done(next_emit):
            if self.stop.is_set():
                return
            try:
                msg = eng.result_q.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_workers(outstanding, last_seen)
                continue
            except (ConnectionError, EOFError, OSError):
                # a slot's file descriptor comes from its worker: if that worker died mid-send, say so
                time.sleep(_POLL_S)
                self._check_workers(outstanding, last_seen)
                raise
            kind, gen, seq, wid = msg[0], msg[1], msg[2], msg[3]
            if kind == "error" and gen == -1:
                _reraise(msg[6])
            if kind == "batch":
                for k in msg[11]:  # slots the worker gave up: let go of our reference too
                    eng.storages.pop((wid, k), None)
            if gen != self.gen:
                if kind == "batch" and msg[4] is not None:
                    self._adopt(wid, msg[4], msg[5])
                    eng.free_qs[wid].put(msg[4])
                continue
            last_seen[wid] = time.monotonic()
            with self._lock:
                outstanding[wid] -= 1
            if kind == "error":
                _reraise(msg[6])
            t0 = time.perf_counter()
            _, _, _, _, slot, new_storage, desc, fails, timing, cache_stats, n_good, _ = msg
            if slot is not None:
                storage = self._adopt(wid, slot, new_storage)
                batch = shm.materialise(
                    desc, storage, pin=self.pin, release=_releaser(eng.free_qs[wid], slot, storage)
                )
            else:
                batch = desc
            if self.tuner is not None and slot is not None:
                self.tuner.saw_batch_bytes(shm.described_bytes(desc))
            timing = dict(timing, transfer_s=time.perf_counter() - t0)
            self.stats.add_stages(timing)
            if cache_stats is not None:
                self.stats.add_cache(cache_stats, wid)
            self._count_failures(failures, fails)
            pending[seq] = (batch, n_good)
            batch = None  # the consumer's drop must be the last reference: it hands the slot back
            if not self.in_order:
                for s in list(pending):
                    self._emit(s, *pending.pop(s), failures)
                    next_emit += 1
                continue
            while next_emit in pending:
                self._emit(next_emit, *pending.pop(next_emit), failures)
                next_emit += 1
        self._put(("end",))

    def _adopt(self, wid: int, slot: int, new_storage: Any) -> torch.UntypedStorage:
        if new_storage is not None:
            self.engine.storages[(wid, slot)] = new_storage
        return self.engine.storages[(wid, slot)]

    def _count_failures(self, failures: list, fails: list[tuple[int, str, str, str]]) -> None:
        for index, key, stage, reason in fails:
            failures.append((index, key, f"{stage}: {reason}"))
            self.stats.failures += 1
            self.stats.failed.append((index, key, reason))
            if self.on_error == "warn":
                logger.warning("skipping sample %d (key %r): %s failed: %s", index, key, stage, reason)
        if self.budget is not None and len(failures) > self.budget:
            raise FailureBudgetExceeded(
                f"{len(failures)} samples failed, more than max_failures allows ({self.budget})", failures
            )

    def _emit(self, seq: int, batch: Any, n_good: int, failures: list) -> None:
        positions = self._sizes.pop(seq)
        if self.decode_batch is not None and n_good:
            batch, n_good = self._decode(seq, batch, failures)
        if not n_good:
            self._put(("skip", positions))
            return
        event = None
        if self.device is not None:
            t0 = time.perf_counter()
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    batch = _to_device(batch, self.device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.stream)
            else:
                batch = _to_device(batch, self.device, non_blocking=False)
            self.stats.add_stages({"device_s": time.perf_counter() - t0})
        self._put(("batch", batch, positions, n_good, event))

    def _decode(self, seq: int, samples: list, failures: list) -> tuple[Any, int]:
        t0 = time.perf_counter()
        samples = list(samples)
        try:
            while samples:
                try:
                    out = self.decode_batch.decode_batch(samples, seed=self.decode_seed(seq))
                    if self.pin:
                        out = _pin(out)
                    return out, len(samples)
                except BatchDecodeError as exc:
                    if self.on_error == "raise":
                        raise
                    bad = {pos for pos, _, _ in exc.failures}
                    fails = [
                        (-1, key, "decode_batch", f"{type(e).__name__}: {e}") for _, key, e in exc.failures
                    ]
                    self._count_failures(failures, fails)
                    samples = [s for p, s in enumerate(samples) if p not in bad]
                    if not bad:
                        raise
            return None, 0
        finally:
            self.stats.add_stages({"decode_batch_s": time.perf_counter() - t0})

    def _check_workers(self, outstanding: list[int], last_seen: list[float]) -> None:
        eng = self.engine
        now = time.monotonic()
        for wid in range(eng.n):
            dead, code = eng.dead(wid)
            if dead and outstanding[wid] > 0:
                raise WorkerDiedError(
                    f"DataLoader worker (pid {eng.pid(wid)}) exited unexpectedly: worker {wid}, exit code {code}, "
                    f"{eng.doing(wid)}; {outstanding[wid]} batch(es) outstanding"
                )
            if self.worker_timeout and outstanding[wid] > 0 and now - last_seen[wid] > self.worker_timeout:
                raise WorkerHungError(
                    f"DataLoader worker {wid} (pid {eng.pid(wid)}) made no progress for {self.worker_timeout:.1f} s "
                    f"{eng.doing(wid)}"
                )


def _reraise(payload: Any) -> None:
    """A worker's error: our own exceptions travel as themselves (a BatchDecodeError keeps its
    type and failures), anything else in torch's ExceptionWrapper (type and worker traceback)."""
    if isinstance(payload, BaseException):
        raise payload
    payload.reraise()


def _releaser(free_q: Any, slot: int, storage: torch.UntypedStorage) -> Callable[[], None]:
    def release() -> None:
        shm.release_pages(storage)  # the consumer is done: only the worker's refill maps them again
        try:
            free_q.put(slot)
        except (ValueError, OSError, AssertionError):  # the pool is already shut down
            logger.debug("slot %d released after shutdown", slot)

    return release


def _to_device(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    return shm.map_leaves(obj, torch.Tensor, lambda t: t.to(device, non_blocking=non_blocking))


def _pin(obj: Any) -> Any:
    """Pinned copies of the CPU tensors in a batch (a GPU decoder's output is left as it is)."""
    return shm.map_leaves(obj, torch.Tensor, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


def _record_stream(obj: Any, stream: Any) -> None:
    """Tell the caching allocator that the consumer's stream uses these tensors, so their memory is
    not handed back to our side stream (and overwritten by the next copy) while still in use."""

    def record(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cuda":
            t.record_stream(stream)
        return t

    shm.map_leaves(obj, torch.Tensor, record)


def failure_budget(max_failures: int | float | None, rank_samples: int) -> int | None:
    """The number of failures allowed this epoch: a count, or a fraction of the rank's share."""
    if max_failures is None:
        return None
    if isinstance(max_failures, float) and 0 <= max_failures < 1:
        return math.floor(max_failures * rank_samples)
    if max_failures < 0:
        raise ValueError(f"max_failures must be >= 0, got {max_failures}")
    return int(max_failures)
