"""A loader worker's read stage: which samples it reads, when, and how far ahead.

Sharded datasets are read ahead on a fetch thread (it knows the worker's tasks in advance; remote
shards are opened before their turn); a plain map-style Dataset is read inline, sample by sample,
each going straight into its batch row. The progress slots say which batch and sample each stage
is on, so a dead or hung worker can be named precisely.

Batched fetches. torch's ``__getitems__`` hook is honoured as torch's fetcher does: with automatic
batching it is called once per batch and its list of samples goes to the collate function. A
dataset that also offers a collated ``get_batch(indices)`` (next to ``get_many``: the stallfree
batched-read protocol, so an unrelated ``get_batch`` of a torch Dataset is never called) is asked
for each batch once where the default collate is the only stage after the read (``Read.COLLATED``):
its ``(B, ...)`` tensors then go into the slot with one write each instead of one per row per
field (``TokenDataset``: 64 row writes per batch before). It must return what
``default_collate(get_many(indices))`` returns; if it raises, the batch is read again per sample,
so ``on_error`` sees the same failures either way.

Which of these reads a worker does, and on which thread, is chosen once (``plan.read_path``);
here each :class:`~stallfree.loader.plan.Read` is one function (``_FETCH``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from stallfree.loader import contracts
from stallfree.loader.messages import Task
from stallfree.loader.plan import Read
from stallfree.loader.worker import lifeline
from stallfree.loader.worker import stages as pipeline
from stallfree.loader.worker.context import WorkerContext
from stallfree.storage.daemon_pool import DaemonThreadPool

logger = logging.getLogger(__name__)

# progress slots, shared with the main process: which batch/sample each stage is on (-1: idle)
MAP_SEQ, MAP_IDX, FETCH_SEQ, FETCH_IDX = range(4)


@dataclass(frozen=True)
class Fetched:
    """A task handed from the read stage to the worker's main thread: its samples (None when the
    main thread reads them itself, inline), the read's timing, and whether they are mapped already
    (stage-cache hits and misses come back mapped)."""

    task: Task
    items: list[Any] | None
    timing: dict[str, float]
    mapped: bool
    batch: Any = None  # the collated batch from ``get_batch`` (then ``items`` is empty)


def map_with_stage_cache(ctx: WorkerContext, indices: list[int], raw_fetch) -> tuple[list[Any], dict]:
    """Stage-cached map: hits skip fetch and decode; misses are fetched, decoded and stored, all
    through ``read_through`` (the raw cache's one path), with the read and the map as its fetch.
    Failed samples come back in place and are never stored."""
    from stallfree.cache.readthrough import read_through

    plan = ctx.plan
    spent = {"map_s": 0.0}

    def read_and_map(missing: list[int]) -> list[Any]:
        raw = raw_fetch(missing)
        t1 = time.perf_counter()
        mapped = pipeline.apply_map(raw, missing, plan.map_fn)
        spent["map_s"] += time.perf_counter() - t1
        return mapped

    t0 = time.perf_counter()
    out = read_through(
        plan.dataset, indices, plan.cache, plan.cache_stage, fingerprint=plan.fingerprint, fetch=read_and_map
    )
    total = time.perf_counter() - t0
    return out, {"fetch_s": total - spent["map_s"], "map_s": spent["map_s"]}


def source_of(ctx: WorkerContext) -> Any:
    return ctx.source if ctx.source is not None else ctx.plan.dataset


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
    """Open (or stage) the shards of the worker's queued tasks before their turn, and, in block
    order, the next window's shards once the current ones are in (remote sharded datasets)."""
    for task in backlog:
        if (task.gen, task.seq) not in warmed:
            warmed.add((task.gen, task.seq))
            try:
                source.warm(source.shards_of(task.indices))
                if task.stage_ahead:
                    source.prefetch(task.stage_ahead)
            except Exception:  # noqa: BLE001 - warming is a hint; the read reports real errors
                logger.debug("warming shards ahead failed", exc_info=True)
    if len(warmed) > 4096:
        warmed.clear()


def follow_epoch(ctx: WorkerContext, task: Task) -> None:
    """A dataset that orders itself per epoch (a mixture) maps positions to samples by epoch:
    set the task's epoch on it before reading (persistent workers live across epochs)."""
    if task.epoch is not None and task.epoch != ctx.epoch:
        ctx.plan.dataset.set_epoch(task.epoch)
        ctx.epoch = task.epoch


def _on_sample(ctx: WorkerContext) -> Callable[[Any], None]:
    progress = ctx.progress

    def on_sample(i: Any) -> None:
        progress[FETCH_IDX] = i if isinstance(i, int) else -1

    return on_sample


def _read_batched(ctx: WorkerContext, indices: list[Any]) -> list[Any]:
    plan = ctx.plan
    return pipeline.fetch(source_of(ctx), indices, plan.cache, _on_sample(ctx), ctx.read_stats)


def _read_per_sample(ctx: WorkerContext, indices: list[Any]) -> list[Any]:
    source, on_sample = source_of(ctx), _on_sample(ctx)
    out = []
    for i in indices:
        on_sample(i)
        out.append(_read_one(source, pipeline.as_index(i)))
    return out


def _fetch_plain(read: Callable[[WorkerContext, list[Any]], list[Any]]) -> Callable[..., Fetched]:
    def fetch(ctx: WorkerContext, task: Task) -> Fetched:
        t0 = time.perf_counter()
        items = read(ctx, task.indices)
        return Fetched(task, items, {"fetch_s": time.perf_counter() - t0}, False)

    return fetch


def _fetch_stage_cached(ctx: WorkerContext, task: Task) -> Fetched:
    items, timing = map_with_stage_cache(ctx, task.indices, lambda idx: _read_batched(ctx, idx))
    return Fetched(task, items, timing, True)


def _fetch_collated(ctx: WorkerContext, task: Task) -> Fetched:
    """The task's batch from ``get_batch`` in one call; read per sample if it raised."""
    if not task.indices:
        return _FETCH[Read.BATCHED](ctx, task)
    t0 = time.perf_counter()
    progress = ctx.progress
    progress[FETCH_IDX] = task.indices[0] if isinstance(task.indices[0], int) else -1
    get_batch = contracts.collated_read_of(source_of(ctx))
    try:
        batch = get_batch([pipeline.as_index(i) for i in task.indices])
    except Exception:  # noqa: BLE001 - the per-sample read finds (and names) the bad sample
        logger.debug(
            "get_batch of %d samples failed; reading them one by one", len(task.indices), exc_info=True
        )
        return _FETCH[Read.BATCHED](ctx, task)
    return Fetched(task, [], {"fetch_s": time.perf_counter() - t0}, False, batch)


# A fetch-stage read (plan.Read) -> the function that reads one task that way. The inline reads
# (STREAMED, GETITEMS) write rows as they go and are ``fetch_streaming``'s.
_FETCH: dict[Read, Callable[[WorkerContext, Task], Fetched]] = {
    Read.COLLATED: _fetch_collated,
    Read.STAGE_CACHED: _fetch_stage_cached,
    Read.BATCHED: _fetch_plain(_read_batched),
    Read.PER_SAMPLE: _fetch_plain(_read_per_sample),
}


def fetch_task(ctx: WorkerContext, task: Task) -> Fetched:
    """Read one task the way the worker's read path says: its raw samples, or its cached/decoded
    samples (stage cache), or its collated batch (``get_batch``)."""
    follow_epoch(ctx, task)
    progress = ctx.progress
    progress[FETCH_SEQ] = task.seq
    try:
        return _FETCH[ctx.path.read](ctx, task)
    finally:
        if progress[FETCH_SEQ] == task.seq:
            progress[FETCH_SEQ], progress[FETCH_IDX] = -1, -1


def _next_task(ctx: WorkerContext, task_q: Any, timeout: float) -> Any:
    """The next task, None when told to stop (or the main process is gone), _NONE when idle."""
    try:
        return task_q.get(timeout=timeout)
    except queue.Empty:
        if not ctx.plan.in_process and lifeline.main_process_gone(ctx.plan.start_method, ctx.plan.parent_pid):
            return None
        return _NONE


_NONE = object()


def tasks_of(ctx: WorkerContext, task_q: Any) -> Iterator[Task]:
    """The worker's tasks until it is told to stop (or its main process is gone)."""
    while True:
        task = _next_task(ctx, task_q, 1.0)
        if task is None:
            return
        if task is not _NONE:
            yield task


def reader_loop(ctx: WorkerContext, task_q: Any, ready: queue.Queue, stop: threading.Event) -> None:
    """Fetch thread: reads the worker's next tasks ahead while the main thread decodes; with
    ``plan.fetch_threads`` > 1 several tasks are read at once (remote stores: hide latency)."""
    plan = ctx.plan
    if plan.fetch_threads <= 1:
        # open queued tasks' shards ahead; not with a cache: hits need no shard (opening costs requests)
        ahead = ctx.source if ctx.path.warm_ahead else None
        backlog: deque = deque()
        warmed: set = set()
        done = False
        while not stop.is_set():
            if not backlog and not done:
                task = _next_task(ctx, task_q, 1.0)
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
            ready.put(fetch_task(ctx, backlog.popleft()))
        ready.put(None)
        return
    pending: deque[Future] = deque()
    done = False
    # daemon threads, not a ThreadPoolExecutor: interpreter exit joins an executor's threads, so
    # a read stuck on a trickling server held the process for its whole deadline after the
    # loader had failed or been dropped (issue 36); told to stop, nothing here waits for a read
    pool = DaemonThreadPool(plan.fetch_threads, thread_name_prefix="stallfree-fetch")
    try:
        while not stop.is_set():
            while pending and pending[0].done():  # hand over in task order
                ready.put(pending.popleft().result())
            if done and not pending:
                break
            if not done and len(pending) < plan.fetch_threads:
                task = _next_task(ctx, task_q, 0.005 if pending else 1.0)
                if task is None:
                    done = True
                elif task is not _NONE:
                    pending.append(pool.submit(fetch_task, ctx, task))
                continue
            wait([pending[0]], timeout=0.5)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    ready.put(None)


def _fetch_getitems(ctx: WorkerContext, task: Task, getitems: Any) -> list:
    """A task's samples from one ``__getitems__`` call, as torch's fetcher reads them. If it
    raises, under ``on_error="raise"`` the batch fails with that error (as in torch: it is named
    by the batch's first index); under skip/warn the samples are read one by one instead, so only
    the bad ones are dropped."""
    indices = [pipeline.as_index(i) for i in task.indices]
    try:
        out = list(getitems(indices))
        if len(out) != len(indices):
            raise RuntimeError(f"__getitems__ returned {len(out)} samples for {len(indices)} indices")
        return out
    except Exception as exc:  # noqa: BLE001 - recorded, the policy decides
        if ctx.plan.on_error == "raise":
            key = contracts.failed_key(source_of(ctx), indices[0], exc)
            failure = pipeline.SampleFailure(indices[0], key, "fetch", exc)
            return [failure] * len(indices)  # the first is the one reported
        logger.debug(
            "__getitems__ of %d samples failed; reading them one by one", len(indices), exc_info=True
        )
    return [_read_one(source_of(ctx), i) for i in indices]


def _read_one(dataset: Any, i: Any) -> Any:
    try:
        return dataset[i]
    except Exception as exc:  # noqa: BLE001 - recorded, the policy decides
        return pipeline.SampleFailure(i, contracts.failed_key(dataset, i, exc), "fetch", exc)


def fetch_streaming(ctx: WorkerContext, task: Task, writer: Any) -> list:
    """Read a task's samples one by one; each good one goes into its row (``writer``) at once.
    A dataset with ``__getitems__`` is read with one call per batch instead (torch's rule), and
    its samples, all alive at once anyway, are collated together."""
    progress = ctx.progress
    progress[FETCH_SEQ] = task.seq
    follow_epoch(ctx, task)
    dataset = source_of(ctx)  # a plain map-style dataset (Where.INLINE): no batched reads of ours
    getitems = contracts.getitems_of(dataset) if ctx.path.read is Read.GETITEMS and task.indices else None
    if getitems is not None:
        progress[FETCH_IDX] = task.indices[0] if isinstance(task.indices[0], int) else -1
        out = _fetch_getitems(ctx, task, getitems)
        progress[FETCH_SEQ], progress[FETCH_IDX] = -1, -1
        return out
    out = []
    for pos, i in enumerate(task.indices):
        progress[FETCH_IDX] = i if isinstance(i, int) else -1
        sample = _read_one(dataset, i)
        if writer is not None and not isinstance(sample, pipeline.SampleFailure):
            sample = writer.put(pos, sample)
        out.append(sample)
    progress[FETCH_SEQ], progress[FETCH_IDX] = -1, -1
    return out
