"""A loader worker's read stage: which samples it reads, when, and how far ahead.

Sharded datasets are read ahead on a fetch thread (it knows the worker's tasks in advance; remote
shards are opened before their turn); a plain map-style Dataset is read inline, sample by sample,
each going straight into its batch row. The progress slots say which batch and sample each stage
is on, so a dead or hung worker can be named precisely.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from stallfree.loader import pipeline

if TYPE_CHECKING:
    from stallfree.loader.workers import WorkerSpec

logger = logging.getLogger(__name__)

# progress slots, shared with the main process: which batch/sample each stage is on (-1: idle)
MAP_SEQ, MAP_IDX, FETCH_SEQ, FETCH_IDX = range(4)


def map_with_stage_cache(spec: WorkerSpec, indices: list[int], raw_fetch) -> tuple[list[Any], dict]:
    """Stage-cached map: hits skip fetch and decode; misses are fetched, decoded and stored."""
    from stallfree.cache.base import CacheKey

    t0 = time.perf_counter()
    keys = [CacheKey(spec.fingerprint, i, spec.stage) for i in indices]
    try:
        cached = spec.cache.get_many(keys)
    except Exception:  # noqa: BLE001 - a broken tier is a miss
        cached = [None] * len(keys)
    miss_pos = [p for p, v in enumerate(cached) if v is None]
    out = list(cached)
    t1 = time.perf_counter()
    if miss_pos:
        miss_idx = [indices[p] for p in miss_pos]
        raw = raw_fetch(miss_idx)
        t2 = time.perf_counter()
        mapped = pipeline.apply_map(raw, miss_idx, spec.map_fn)
        fresh = []
        for p, v in zip(miss_pos, mapped, strict=False):
            out[p] = v
            if not isinstance(v, pipeline.SampleFailure):
                fresh.append((keys[p], v))
        if fresh:
            try:
                spec.cache.put_many(fresh)
            except Exception:  # noqa: BLE001 - caching is best effort; the batch is still good
                logger.warning("could not cache %d decoded samples", len(fresh), exc_info=True)
        t3 = time.perf_counter()
    else:
        t2 = t3 = t1
    return out, {"fetch_s": (t1 - t0) + (t2 - t1), "map_s": t3 - t2}


def source_of(spec: WorkerSpec) -> Any:
    return spec.source if spec.source is not None else spec.dataset


def _drain(task_q: Any, backlog: deque) -> bool:
    """Move the tasks already queued for this worker into ``backlog``; True if told to stop."""
    while True:
        try:
            task = task_q.get_nowait()
        except queue.Empty:
            return False
        if task is None:
            return True
        backlog.append(task)


def _warm_ahead(source: Any, backlog: deque, warmed: set) -> None:
    """Open the shards of the worker's queued tasks before their turn (remote sharded datasets)."""
    for gen, seq, indices, _ in backlog:
        if (gen, seq) not in warmed:
            warmed.add((gen, seq))
            try:
                source.warm(source.shards_of(indices))
            except Exception:  # noqa: BLE001 - warming is a hint; the read reports real errors
                logger.debug("warming shards ahead failed", exc_info=True)
    if len(warmed) > 4096:
        warmed.clear()


def _fetch_task(spec: WorkerSpec, task: tuple, progress: Any) -> tuple:
    """Read one task's raw samples (or, with a stage cache, its cached/decoded samples)."""
    gen, seq, indices, seed = task
    t0 = time.perf_counter()
    progress[FETCH_SEQ] = seq

    def on_sample(i: int) -> None:
        progress[FETCH_IDX] = i

    if spec.stage is not None and spec.cache is not None and not spec.raw_only:
        items, timing = map_with_stage_cache(
            spec,
            indices,
            lambda idx: pipeline.fetch(source_of(spec), idx, spec.cache, on_sample, spec.read_stats),
        )
        mapped = True
    else:
        items = pipeline.fetch(source_of(spec), indices, spec.cache, on_sample, spec.read_stats)
        timing, mapped = {"fetch_s": time.perf_counter() - t0}, False
    if progress[FETCH_SEQ] == seq:
        progress[FETCH_SEQ], progress[FETCH_IDX] = -1, -1
    return (gen, seq, indices, items, timing, mapped, seed)


def _next_task(spec: WorkerSpec, task_q: Any, timeout: float) -> Any:
    """The next task, None when told to stop (or the main process is gone), _NONE when idle."""
    try:
        return task_q.get(timeout=timeout)
    except queue.Empty:
        if not spec.in_process and _main_process_gone(spec):
            return None
        return _NONE


def _main_process_gone(spec: WorkerSpec) -> bool:
    """Whether the process that made this worker has exited. The sentinel that multiprocessing
    gives every child (a pipe from its creator, at EOF once the creator is gone) is right under
    fork, spawn and forkserver alike; the parent pid is not: under a fork server the parent is the
    server. Under fork a sibling forked later may hold the pipe open too, so a changed parent pid
    (re-parented to init) also counts there."""
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        return True
    return spec.start_method == "fork" and os.getppid() != spec.parent_pid


_NONE = object()


def reader_loop(
    spec: WorkerSpec, task_q: Any, ready: queue.Queue, stop: threading.Event, progress: Any
) -> None:
    """Fetch thread: reads the worker's next tasks ahead while the main thread decodes; with
    ``spec.fetch_threads`` > 1 several tasks are read at once (remote stores: hide latency)."""
    if spec.fetch_threads <= 1:
        # open queued tasks' shards ahead; not with a cache: hits need no shard (opening costs requests)
        ahead = spec.source if hasattr(spec.source, "warm") and spec.cache is None else None
        backlog: deque = deque()
        warmed: set = set()
        done = False
        while not stop.is_set():
            if not backlog and not done:
                task = _next_task(spec, task_q, 1.0)
                if task is None:
                    done = True
                elif task is not _NONE:
                    backlog.append(task)
            if ahead is not None and not done:
                done = _drain(task_q, backlog)
                _warm_ahead(ahead, backlog, warmed)
            if not backlog:
                if done:
                    break
                continue
            ready.put(_fetch_task(spec, backlog.popleft(), progress))
        ready.put(None)
        return
    pending: deque[Future] = deque()
    done = False
    with ThreadPoolExecutor(spec.fetch_threads, thread_name_prefix="stallfree-fetch") as pool:
        while not stop.is_set():
            while pending and pending[0].done():  # hand over in task order
                ready.put(pending.popleft().result())
            if done and not pending:
                break
            if not done and len(pending) < spec.fetch_threads:
                task = _next_task(spec, task_q, 0.005 if pending else 1.0)
                if task is None:
                    done = True
                elif task is not _NONE:
                    pending.append(pool.submit(_fetch_task, spec, task, progress))
                continue
            wait([pending[0]], timeout=0.5)
    ready.put(None)


def reads_inline(spec: WorkerSpec) -> bool:
    """Whether this worker reads its samples itself, one by one, instead of on a fetch thread.

    For a plain map-style dataset (torch's Dataset, decode in ``__getitem__``) there is no raw
    read to overlap with a decode step: a fetch thread would only hold whole batches of decoded
    samples ahead (measured: +35 MiB per worker of 19 MB batches). Read inline, each sample goes
    into its batch row as soon as ``__getitem__`` returns, and only that sample is alive."""
    return (
        not spec.in_process
        and spec.map_fn is None
        and spec.batch_decode is None
        and spec.cache is None
        and not spec.raw_only
        and spec.fetch_threads <= 1
        and not hasattr(spec.dataset, "get_many")
    )


def inline_tasks(spec: WorkerSpec, task_q: Any) -> Iterator[tuple]:
    """Tasks as the fetch thread would hand them over, with the samples left to ``_process``."""
    while True:
        task = _next_task(spec, task_q, 1.0)
        if task is None:
            return
        if task is not _NONE:
            gen, seq, indices, seed = task
            yield (gen, seq, indices, None, {}, False, seed)


def fetch_streaming(spec: WorkerSpec, seq: int, indices: list[int], progress: Any, writer: Any) -> list:
    """Read a task's samples one by one; each good one goes into its row (``writer``) at once."""
    progress[FETCH_SEQ] = seq
    out = []
    for pos, i in enumerate(indices):
        progress[FETCH_IDX] = int(i)
        sample = pipeline.fetch(source_of(spec), [i], None, None, spec.read_stats)[0]
        if writer is not None and not isinstance(sample, pipeline.SampleFailure):
            sample = writer.put(pos, sample)
        out.append(sample)
    progress[FETCH_SEQ], progress[FETCH_IDX] = -1, -1
    return out
