"""The worker pool: processes (or one in-process thread for ``num_workers=0``), their queues and
shared slots, and an orderly (or, after a failure, immediate) shutdown. Lives for one epoch, or for
the loader's lifetime with ``persistent_workers``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from stallfree.loader.fetch import FETCH_IDX, FETCH_SEQ, MAP_IDX, MAP_SEQ
from stallfree.loader.workers import WorkerSpec, worker_main

logger = logging.getLogger(__name__)


class Engine:
    """Workers and their queues; lives for one epoch, or for the loader when persistent."""

    def __init__(self, spec: WorkerSpec, num_workers: int, mp_context: Any = None) -> None:
        self.spec = spec
        self.in_process = num_workers == 0
        self.n = max(1, num_workers)
        self.storages: dict[tuple[int, int], torch.UntypedStorage] = {}
        self.gen = 0
        self.closed = False
        if self.in_process:
            spec.in_process, spec.use_shm = True, False
            self.task_qs = [queue.Queue()]
            self.free_qs = [queue.Queue()]
            self.result_q: Any = queue.Queue()
            self.progress = [[-1, -1, -1, -1]]
            self.procs: list[Any] = [
                threading.Thread(
                    target=worker_main,
                    args=(0, spec, self.task_qs[0], self.free_qs[0], self.result_q, self.progress[0]),
                    daemon=True,
                    name="stallfree-worker",
                )
            ]
        else:
            import torch.multiprocessing  # noqa: F401 - registers tensor/storage reductions

            ctx = _context(mp_context)
            spec.start_method, spec.parent_pid = ctx.get_start_method(), os.getpid()
            self.task_qs = [ctx.Queue() for _ in range(self.n)]
            self.free_qs = [ctx.Queue() for _ in range(self.n)]
            self.result_q = ctx.Queue()
            self.progress = [ctx.RawArray("q", 4) for _ in range(self.n)]
            for p in self.progress:
                p[:] = [-1, -1, -1, -1]
            self.procs = [
                ctx.Process(
                    target=worker_main,
                    args=(w, spec, self.task_qs[w], self.free_qs[w], self.result_q, self.progress[w]),
                    daemon=True,
                    name=f"stallfree-worker-{w}",
                )
                for w in range(self.n)
            ]
        with _frozen_gc(not self.in_process and spec.start_method == "fork"):
            for p in self.procs:
                p.start()

    def doing(self, wid: int) -> str:
        """What worker ``wid`` is busy with, for error messages (reading beats decoding: it is earlier)."""
        p = self.progress[wid]
        if p[FETCH_IDX] >= 0:
            return f"while reading sample {p[FETCH_IDX]} (batch {p[FETCH_SEQ]})"
        if p[MAP_IDX] >= 0:
            return f"while loading sample {p[MAP_IDX]} (batch {p[MAP_SEQ]})"
        return "while idle"

    def pid(self, wid: int) -> int | None:
        return getattr(self.procs[wid], "pid", None)

    def dead(self, wid: int) -> tuple[bool, int | None]:
        p = self.procs[wid]
        if self.in_process:
            return (not p.is_alive(), None)
        return (not p.is_alive(), p.exitcode)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers: ask politely (draining their output so none blocks on a full pipe),
        and terminate whoever is still there after a grace period (at once when not graceful)."""
        if self.closed:
            return
        self.closed = True
        for q in self.task_qs:
            try:
                q.put(None)
            except (OSError, ValueError):
                logger.debug("task queue already closed")
        deadline = time.monotonic() + (3.0 if graceful else 0.0)
        while time.monotonic() < deadline and any(p.is_alive() for p in self.procs):
            try:
                while True:
                    self.result_q.get_nowait()
            except (queue.Empty, OSError, ValueError, EOFError):
                time.sleep(0.01)
        if not self.in_process:
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
            for p in self.procs:
                p.join(timeout=1.0)
            for q in [*self.task_qs, *self.free_qs, self.result_q]:
                q.cancel_join_thread()
                q.close()
        self.storages.clear()


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


def _context(mp_context: Any) -> Any:
    if mp_context is None:
        return mp.get_context()
    if isinstance(mp_context, str):
        return mp.get_context(mp_context)
    return mp_context
