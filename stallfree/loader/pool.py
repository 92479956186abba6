"""The worker pool: processes (or one in-process thread for ``num_workers=0``), their queues and
shared slots, and an orderly (or, after a failure, immediate) shutdown. Lives for one epoch, or for
the loader's lifetime with ``persistent_workers``.

Nothing here may wait forever: a pool is shut down from iterator finalisers and at interpreter
exit as well as at an epoch's end. Queues never join their feeder threads at exit (a worker that
stopped reading would hold the process forever), slot returns never block (returns.py), and every
pool still alive at exit is stopped before multiprocessing's own exit handler runs.
"""

from __future__ import annotations

import atexit
import codecs
import collections
import contextlib
import gc
import logging
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - its exit handler is registered before ours, so ours runs first
import os
import queue
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import torch

from stallfree.loader import _torch_compat as compat
from stallfree.loader import first_batch_inline as inline_first
from stallfree.loader.messages import Task
from stallfree.loader.plan import WorkerPlan
from stallfree.loader.shm.returns import SlotReturns
from stallfree.loader.shm.segments import SegmentReceiver, SentSegment, socket_pair
from stallfree.loader.worker.first_batch_gate import FirstBatchGate
from stallfree.loader.worker.main import worker_main
from stallfree.loader.worker.read import FETCH_IDX, FETCH_SEQ, MAP_IDX, MAP_SEQ

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet = weakref.WeakSet()

# A module imported for the first time by another thread while a worker forks leaves its import
# lock held in the worker, for ever. ``getaddrinfo`` imports the idna codec on a process's first
# connection by host name, and the main process opens connections from threads (staging a shard
# ahead, the cache's clients) while it forks: a worker's first S3 connection then waited on
# that lock for ever (3 runs in 88 under load). Looked up once here, before any fork.
codecs.lookup("idna")


@runtime_checkable
class RemoteWorkers(Protocol):
    """What ``DataLoader(remote=...)`` takes (``stallfree.RayWorkers``, ``stallfree/engines/``):
    workers elsewhere that join each epoch's local pool behind the same dispatcher."""

    def depth_for(self, local_workers: int) -> int:
        """Batches added to the loader's in-flight bound beside ``local_workers`` processes."""
        ...

    def pool(self, local: Engine, plan: WorkerPlan, prefetch_factor: int, pin_memory: bool) -> Any: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class Engine:
    """Workers and their queues; lives for one epoch, or for the loader when persistent."""

    # A pool with remote workers beside these (``stallfree/engines/ray_pool.py``) has more batches
    # in flight (its ``remote_depth``), picks each batch's worker itself (``pick``) and may run a
    # batch on another worker than the one it was sent to (``charged_to``); this one does not.
    remote_depth = 0

    def pick(self) -> int | None:
        raise NotImplementedError("a local pool leaves the choice of worker to the assembler")

    def charged_to(self, msg: Any) -> int:
        """The worker the assembler counted ``msg``'s batch against: the one that made it."""
        return msg.worker

    def __init__(self, plan: WorkerPlan, num_workers: int, mp_context: Any = None) -> None:
        self.in_process = num_workers == 0
        self.n = max(1, num_workers)
        self.storages: dict[tuple[int, int], torch.UntypedStorage] = {}
        self.gen = 0
        self.closed = False
        self.gate: FirstBatchGate | None = None
        self.segments: list[SegmentReceiver] = []  # per worker process: new slots' descriptors
        self.inline_results: collections.deque = collections.deque()  # made here: inline_first.py
        self._inline_next = False  # the next task sent is made here, before any worker starts
        pairs: list[tuple[Any, Any]] = []  # (main's end, worker's end) of each worker's socket pair
        if self.in_process:
            self.plan = replace(plan, in_process=True)
            self.task_qs: list[Any] = [queue.Queue()]
            self.returns = [SlotReturns()]
            self.result_q: Any = queue.Queue()
            self.progress: list[Any] = [[-1, -1, -1, -1]]
            self.procs: list[Any] = [
                threading.Thread(
                    target=worker_main,
                    args=(0, self.plan, self.task_qs[0], self.returns[0], self.result_q, self.progress[0]),
                    daemon=True,
                    name="stallfree-worker",
                )
            ]
        else:
            import torch.multiprocessing  # noqa: F401 - registers tensor/storage reductions

            ctx = _context(mp_context)
            self.plan = replace(
                plan,
                start_method=ctx.get_start_method(),
                parent_pid=os.getpid(),
                forked_by_main_thread=threading.current_thread() is threading.main_thread(),
            )
            self.task_qs = [ctx.Queue() for _ in range(self.n)]
            for q in self.task_qs:
                q.cancel_join_thread()  # never wait at exit for tasks a dead worker will not read
            self.returns = [SlotReturns(ctx) for _ in range(self.n)]
            self.result_q = ctx.Queue()
            self.progress = [ctx.RawArray("q", 4) for _ in range(self.n)]
            for p in self.progress:
                p[:] = [-1, -1, -1, -1]
            # the first batch is made here (inline_first.py), or a worker leads it (first_batch.py)
            self._inline_next = inline_first.runs_inline(self.plan)
            lead = self.n > 1 and self.plan.batch_decode is not None and not self._inline_next
            self.gate = FirstBatchGate(ctx) if lead else None
            pairs = [socket_pair() for _ in range(self.n)] if self.plan.use_shm else []
            self.segments = [SegmentReceiver(mine, w) for w, (mine, _) in enumerate(pairs)]
            self.procs = [
                ctx.Process(
                    target=worker_main,
                    args=(
                        w,
                        self.plan,
                        self.task_qs[w],
                        self.returns[w],
                        self.result_q,
                        self.progress[w],
                        self.gate,
                        pairs[w][1] if pairs else None,
                    ),
                    daemon=True,
                    name=f"stallfree-worker-{w}",
                )
                for w in range(self.n)
            ]
        self._pairs = pairs
        self._unstarted = list(self.procs)
        _LIVE.add(self)
        if not self._inline_next:  # else every worker starts once the first task is made here
            self._start(1)  # the rest once the first has its first task: start_rest()

    def _start(self, count: int | None = None) -> None:
        """Start ``count`` more workers (all that are left: None)."""
        todo = self._unstarted[: len(self._unstarted) if count is None else count]
        if not todo:
            return
        del self._unstarted[: len(todo)]
        try:
            forking = not self.in_process and self.plan.start_method == "fork"
            with _frozen_gc(forking), _sigterm_blocked(forking):
                for p in todo:
                    _start_worker(p)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        finally:
            if not self._unstarted:
                for _, theirs in self._pairs:
                    theirs.close()  # the workers hold their own copies now

    def start_rest(self) -> None:
        """Start the workers not started yet (none left: nothing).

        Why apart: each fork of a large training process costs 8-15 ms of the main thread, and
        the first worker sat idle through the others' before its first task came (bench_startup.py:
        ``iter()`` 27 ms with two forks). The assembler sends the first tasks, then calls this."""
        if not self.closed:
            self._start()

    def storage_of(self, worker: int, new_storage: Any) -> Any:
        """A batch's announced storage: read from the worker's socket when it sent a descriptor
        there (segments.py), else the storage that came in the message."""
        if isinstance(new_storage, SentSegment):
            return self.segments[worker].receive(new_storage)
        return new_storage

    def discard_segment(self, worker: int, new_storage: Any) -> None:
        """A batch that will not be adopted: its descriptor, if sent apart, is closed."""
        if isinstance(new_storage, SentSegment):
            self.segments[worker].discard(new_storage)

    def send(self, worker: int, task: Task) -> None:
        if self._inline_next:  # the pool's first task: made here, as ``worker`` would make it
            self._inline_next = False
            self.inline_results.append(inline_first.run(self.plan, task))
            return
        if self.gate is not None:  # before the put: the worker reads it once it has the task
            self.gate.mark_sent(task.gen, task.seq)
        self.task_qs[worker].put(task)

    def result(self, timeout: float) -> Any:
        """The next worker message: one made in this process first, else from the result queue
        (``queue.Empty`` after ``timeout``)."""
        if self.inline_results:
            return self.inline_results.popleft()
        return self.result_q.get(timeout=timeout)

    def doing(self, wid: int) -> str:
        """What worker ``wid`` is busy with, for error messages: the stage on the earlier batch (the
        fetch thread may already read the next batch while the main thread decodes this one)."""
        p = self.progress[wid]
        loading_earlier = p[MAP_IDX] >= 0 and 0 <= p[MAP_SEQ] < p[FETCH_SEQ]
        if p[FETCH_IDX] >= 0 and not loading_earlier:
            return f"while reading sample {p[FETCH_IDX]} (batch {p[FETCH_SEQ]})"
        if p[MAP_IDX] >= 0:
            return f"while loading sample {p[MAP_IDX]} (batch {p[MAP_SEQ]})"
        if p[FETCH_SEQ] >= 0:
            return f"while reading batch {p[FETCH_SEQ]}"
        if p[MAP_SEQ] >= 0:
            return f"while loading batch {p[MAP_SEQ]}"
        return "while waiting for work"

    def progress_mark(self, wid: int) -> tuple[int, ...]:
        """Worker ``wid``'s progress slots now: any change means it moved on (not hung)."""
        return tuple(self.progress[wid][:])

    def pid(self, wid: int) -> int | None:
        return None if self.in_process else self.procs[wid].pid

    def dead(self, wid: int) -> tuple[bool, int | None]:
        p = self.procs[wid]
        if self.in_process:
            return (not p.is_alive(), None)
        return (not _alive(p), p.exitcode)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers: ask politely (draining their output so none blocks on a full pipe),
        and terminate whoever is still there after a grace period (at once when not graceful).
        Bounded: at most ~3 s graceful, ~1 s otherwise; safe from finalisers and at exit."""
        if self.closed:
            return
        self.closed = True
        _LIVE.discard(self)
        for r in self.returns:
            r.close()
        if self.in_process:
            # a thread cannot be terminated: tasks not started are dropped so that the None
            # below is its next one, and it is waited for (bounded) even when not graceful. One
            # left running inside torch while the interpreter tore down at exit aborted it
            # ("terminate called without an active exception", SIGABRT, ~1 exit in 16)
            for q in self.task_qs:
                with contextlib.suppress(queue.Empty):
                    while True:
                        q.get_nowait()
        if graceful or self.in_process:
            for q in self.task_qs:
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001 - a closed queue: the worker is gone anyway
                    logger.debug("task queue already closed")
        deadline = time.monotonic() + (3.0 if graceful else 1.0 if self.in_process else 0.0)
        while time.monotonic() < deadline and any(_alive(p) for p in self.procs):
            try:
                while True:
                    self.result_q.get_nowait()
            except Exception:  # noqa: BLE001 - empty, closed or torn: keep waiting out the grace period
                time.sleep(0.01)
        if not self.in_process:
            started = [p for p in self.procs if p.pid is not None]
            for p in started:
                if p.is_alive():
                    p.terminate()
            end = time.monotonic() + 1.0
            for p in started:
                p.join(timeout=max(0.0, end - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(timeout=0.1)
            gone = [p.pid for p in started if p.exitcode is not None]
            swept = compat.remove_leftover_segments(gone)  # names a worker ended mid-creation left
            if swept:
                logger.debug(
                    "removed %d shared-memory name(s) left by stopped workers: %s", len(swept), swept
                )
            for q in [*self.task_qs, self.result_q]:
                q.cancel_join_thread()
                q.close()
        for seg in self.segments:
            seg.close()
        for _, theirs in self._pairs:
            theirs.close()  # (those of workers never started)
        self.storages.clear()


def _start_worker(p: Any) -> None:
    """Start one worker; a worker whose arguments do not pickle (spawn, forkserver) gets torch's
    own warning first, so scripts see what they see with torch's DataLoader."""
    from pickle import PicklingError

    try:
        p.start()
    except (TypeError, AttributeError, PicklingError):
        warnings.warn(
            "Got pickle error when attempting to start a worker Process. "
            "This might be because the worker Process arguments are not picklable. "
            "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
            "to 'forkserver', which requires the worker Process arguments to be picklable. "
            "You can also try multiprocessing.set_start_method('fork').",
            stacklevel=2,
        )
        raise


def _alive(p: Any) -> bool:
    """A thread, or a process that was started, still running."""
    return p.is_alive() if isinstance(p, threading.Thread) else p.pid is not None and p.is_alive()


def _shutdown_all_at_exit() -> None:
    """Stop every pool still running (an iterator kept alive by a traceback, a persistent pool)
    before multiprocessing's exit handler joins queues a dead worker would never read."""
    for engine in list(_LIVE):
        with contextlib.suppress(Exception):
            engine.shutdown(graceful=False)


atexit.register(_shutdown_all_at_exit)


@contextlib.contextmanager
def _frozen_gc(on: bool) -> Iterator[None]:
    """Fork with every object of the parent in the collector's permanent generation.

    A forked worker must never run the finalisers of the parent's garbage: a reference cycle not
    yet collected when the worker forked (a DALI pipeline, say) would otherwise be collected in the
    worker, and its ``__del__`` would stop threads that do not exist there (observed: a segfault
    in ``nvidia.dali.Pipeline.__del__`` inside a worker). Frozen objects are never collected in
    the child, and its collector does not walk (and so copy-on-write) the parent's heap. The
    parent unfreezes at once, so its own collection is unchanged.
    """
    if not on:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _sigterm_blocked(on: bool) -> Iterator[None]:
    """Fork with SIGTERM blocked; the worker unblocks it once its own handler is in place.

    A forked worker starts with the training process's Python SIGTERM handler. A SIGTERM that
    reached it before the worker reset that handler ran the trainer's code in the worker. This
    pool sends one itself when a loader is dropped right after its workers forked (``iter()``
    then ``del``: 65 of 200 tries): Ray's handler raised ``SystemExit`` there, and the copy of
    the trainer unwound its own stack (a pytest worker's copy reported a test failure). Blocked,
    the signal waits and then ends the worker as any SIGTERM does."""
    if not on:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _context(mp_context: Any) -> Any:
    if mp_context is None:
        return mp.get_context()
    if isinstance(mp_context, str):
        return mp.get_context(mp_context)
    return mp_context
