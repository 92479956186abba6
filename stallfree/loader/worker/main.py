"""Worker processes (or, with ``num_workers=0``, one in-process thread): they execute the plan.

Each worker reads its tasks' samples (fetch.py: ahead on a fetch thread, or inline for a plain
Dataset), maps them on its main thread, runs a worker-side batch decoder, collates straight into a
shared-memory slot (slots.py, rows.py) and sends a :class:`~stallfree.loader.messages.BatchReady`
(a small description of the batch) or a :class:`~stallfree.loader.messages.WorkerFailure` (naming
the worker and the sample). What to do was decided once, in the :class:`WorkerPlan`; what changes
while the worker runs lives in its :class:`WorkerContext`.

``get_worker_info`` is torch's: our workers set torch's worker info, so user code calling
``torch.utils.data.get_worker_info()`` sees the same thing as with torch's DataLoader.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import queue
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from stallfree.errors import BatchDecodeError
from stallfree.loader import _torch_compat as compat
from stallfree.loader import contracts
from stallfree.loader.messages import BatchReady, FailedSample, Task, WorkerFailure
from stallfree.loader.plan import Where, WorkerPlan
from stallfree.loader.shm import heap as allocator
from stallfree.loader.shm import rows
from stallfree.loader.shm import slots as slots_mod
from stallfree.loader.shm import storage as shm
from stallfree.loader.shm.returns import SlotReturns
from stallfree.loader.shm.segments import SegmentSender
from stallfree.loader.stats import CACHE_COUNTERS, is_cache_ratio
from stallfree.loader.worker import lifeline
from stallfree.loader.worker import read as fetch
from stallfree.loader.worker import shards as shardio
from stallfree.loader.worker import stages as pipeline
from stallfree.loader.worker.context import WorkerContext
from stallfree.loader.worker.first_batch_gate import FirstBatchGate, FirstDecode
from stallfree.loader.worker.read import MAP_IDX, MAP_SEQ, Fetched

logger = logging.getLogger(__name__)

__all__ = ["get_worker_info", "WorkerContext", "worker_main"]


def get_worker_info() -> Any:
    """Inside a loader worker: its ``WorkerInfo`` (id, num_workers, seed, dataset); else None."""
    return compat.get_worker_info()


def _seed_worker(plan: WorkerPlan, wid: int) -> int:
    seed = (plan.base_seed + wid) % 2**63
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(compat.worker_numpy_seed(plan.base_seed, wid))
    return seed


def _wrap(exc: BaseException, wid: int, doing: str | None) -> Any:
    where = f"in DataLoader worker process {wid}"
    if doing:
        where += f" {doing}"
    return compat.wrap_exception(exc, where)


def _batch_stage(stage: str, task: Task, indices: list[Any]) -> str:
    """What a worker was doing when a whole batch failed (collate, a batch decoder's bug): a
    batch step, not a sample load (a collate_fn error once read "while loading sample 0")."""
    first = f", first index {indices[0]}" if indices else ""
    return f"while {stage} batch {task.seq} ({len(indices)} samples{first})"


def _start(ctx: WorkerContext) -> None:
    """Per-process set-up: seeds, torch's worker info, the user's worker_init_fn, the source."""
    plan = ctx.plan
    if not plan.in_process:
        lifeline.bind_to_parent(plan.start_method, plan.parent_pid, plan.forked_by_main_thread)
        if not faulthandler.is_enabled():  # a crash in native code (a decoder) leaves a Python stack
            with contextlib.suppress(Exception):
                faulthandler.enable()
        # A forked worker inherits the training process's Python SIGTERM handler (Lightning's
        # only logs), and the loader's shutdown then waits a second before it kills the worker.
        # Workers end on SIGTERM; a worker_init_fn may still install its own handler.
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # a forked worker starts with SIGTERM blocked (pool._sigterm_blocked): one sent before
        # the line above is delivered now, to the default action
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        allocator.keep_freed_memory()  # for a spawned worker; a forked one has the parent's already
        torch.set_num_threads(1)
        seed = _seed_worker(plan, ctx.wid)
        compat.set_worker_info(ctx.wid, plan.num_workers, seed, plan.dataset)
        if plan.worker_init_fn is not None:
            try:
                plan.worker_init_fn(ctx.wid)
            except Exception as exc:  # noqa: BLE001 - reported with each task, as torch does
                ctx.init_error = _wrap(exc, ctx.wid, "in worker_init_fn")
                return
    if isinstance(plan.batch_decode, contracts.ThreadedDecoder):
        plan.batch_decode.use_threads(plan.threads)  # this worker's share of the cores
    ctx.source = shardio.ConcurrentShards(plan.dataset, staging=plan.staging) if ctx.path.concurrent else None
    if plan.cache is not None:
        from stallfree.cache.readthrough import ReadStats

        ctx.read_stats = ReadStats()
        ctx.cache_baseline = _cache_stats(plan.cache, ctx.read_stats)


def worker_main(
    wid: int,
    plan: WorkerPlan,
    task_q: Any,
    returns: SlotReturns,
    result_q: Any,
    progress: Any,
    gate: FirstBatchGate | None = None,
    segment_socket: Any = None,
) -> None:
    """Entry point of one worker (a process, or a thread when ``plan.in_process``). ``gate``:
    the pool's first batch decodes on every worker's cores (first_batch.py); ``segment_socket``:
    where new slots' descriptors go (segments.py)."""
    if not plan.in_process:
        # results still buffered when told to stop are not needed: never wait on the pipe at exit
        result_q.cancel_join_thread()
    ctx = WorkerContext(wid, plan, progress, plan.read_path)
    _start(ctx)
    first = FirstDecode(gate, plan.batch_decode, plan.threads, plan.num_workers)
    if ctx.init_error is not None:
        for task in fetch.tasks_of(ctx, task_q):
            result_q.put(WorkerFailure(task.gen, task.seq, wid, None, None, ctx.init_error))
            first.task_done(task.gen, task.seq)
        return
    stop = threading.Event()
    ready: queue.Queue = queue.Queue(maxsize=2)
    reader = None
    where = ctx.path.where  # chosen once: plan.read_path
    if where is Where.INLINE:  # _load reads each task itself, straight into the rows
        tasks: Iterator[Fetched] = (Fetched(t, None, {}, False) for t in fetch.tasks_of(ctx, task_q))
    elif where is Where.MAIN:
        tasks = (fetch.fetch_task(ctx, t) for t in fetch.tasks_of(ctx, task_q))
    else:
        reader = threading.Thread(
            target=fetch.reader_loop, args=(ctx, task_q, ready, stop), daemon=True, name=f"fetch-{wid}"
        )
        reader.start()
        tasks = iter(ready.get, None)
    slots = slots_mod.Slots(plan.max_slots, returns)
    sender = SegmentSender(segment_socket) if segment_socket is not None else None
    try:
        for item in tasks:
            progress[MAP_SEQ], progress[MAP_IDX] = item.task.seq, _first(item.task.indices)
            msg = process(ctx, slots, item, first)
            progress[MAP_SEQ], progress[MAP_IDX] = -1, -1
            if sender is not None and isinstance(msg, BatchReady) and msg.new_storage is not None:
                sent = sender.send(msg.new_storage)  # the descriptor first: it is there before the batch
                if sent is not None:
                    msg = replace(msg, new_storage=sent)
            result_q.put(msg)
            first.task_done(item.task.gen, item.task.seq)
            if isinstance(msg, BatchReady) and msg.handover:
                slots.handed_over(msg.slot)  # the consumer's now: this worker lets go of it
            elif (
                isinstance(msg, BatchReady) and msg.slot is not None and not _unmapped(item, slots, msg.slot)
            ):
                shm.release_pages(slots.storages[msg.slot])  # the main process's until it returns
    except KeyboardInterrupt:
        return
    finally:
        stop.set()
        if reader is not None:
            with contextlib.suppress(queue.Empty):  # a reader blocked on the full queue sees stop next
                while True:
                    ready.get_nowait()
            reader.join(timeout=2.0)  # let it finish its read before its source closes under it
        if ctx.source is not None:
            ctx.source.close()
            ctx.source = None
        if sender is not None:
            sender.close()


def _unmapped(item: Fetched, slots: slots_mod.Slots, slot: int) -> bool:
    """Whether this worker wrote the batch without mapping its slot: a collated batch of CPU
    arrays written through the slot's file. Then there are no pages to let go of, and the
    ``madvise`` would only cost a system call (and TLB work) per batch."""
    if item.batch is None or slots.file(slot) is None:
        return False
    cpu = [True]

    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            cpu[0] = False
        return t

    shm.map_leaves(item.batch, (torch.Tensor, np.ndarray), leaf)
    return cpu[0]


def _first(indices: list[Any]) -> int:
    """The first index of a task as a progress number (-1 when there is none or it is not an int)."""
    try:
        return int(indices[0]) if indices else -1
    except (TypeError, ValueError):
        return -1


@dataclass
class _Loaded:
    """A task's samples after read and map, and where their rows went (if streamed)."""

    items: list[Any]
    timing: dict[str, float]
    slot: int | None = None
    writer: rows.RowWriter | None = None


def _row_writer(slots: slots_mod.Slots, n: int) -> tuple[int, rows.RowWriter]:
    """A slot for the next batch and the writer that puts its samples' rows into it."""
    slot = slots.acquire()
    return slot, rows.RowWriter(
        n, functools.partial(slots.reserve, slot), functools.partial(slots.file, slot)
    )


def _load(ctx: WorkerContext, slots: slots_mod.Slots, item: Fetched) -> _Loaded:
    """Read (inline tasks) or map (``decode=``) a task's samples, each going into its batch row as
    it is ready where the default collate applies."""
    plan, task = ctx.plan, item.task
    t0 = time.perf_counter()
    writer = slot = None
    items, timing = item.items, dict(item.timing)
    map_s = 0.0
    if items is None:  # an inline task (Where.INLINE): read here, straight into the rows
        if plan.streams_rows:
            slot, writer = _row_writer(slots, len(task.indices))
        items = fetch.fetch_streaming(ctx, task, writer)
        timing["fetch_s"] = time.perf_counter() - t0
    elif not item.mapped and plan.maps_samples:
        if plan.streams_rows:
            slot, writer = _row_writer(slots, len(items))
        items = _map_tracking(ctx, items, task.indices, writer)
        map_s = time.perf_counter() - t0
    timing["map_s"] = timing.get("map_s", 0.0) + map_s
    if writer is not None:
        items = writer.final(items)
    return _Loaded(items, timing, slot, writer)


def _into_slot(
    ctx: WorkerContext,
    slots: slots_mod.Slots,
    loaded: _Loaded,
    good: list[Any],
    alloc: slots_mod.SlotAlloc | None,
    decoded: Any,
) -> tuple[int | None, Any, Any]:
    """Collate the good samples (unless decoded already) and describe the batch in its slot.

    Returns (slot, storage to announce, message payload); slot None when the payload is the batch
    itself (nothing array-like in it, or no shared memory)."""
    plan, slot, writer = ctx.plan, loaded.slot, loaded.writer
    if not plan.use_shm:  # same memory: the batch itself (decoded already, or collated here)
        return None, None, decoded if decoded is not None else _collate(plan, good, None)
    if slot is None:
        slot = slots.acquire()
    storage = slots.storages[slot]
    new_storage = slots.announce(slot)
    streamed = writer is not None and writer.active and writer.arena is not None
    arena = writer.arena if streamed else shm.Arena(storage)
    if alloc is not None and alloc.arena is not None:
        arena = alloc.arena  # the decoder wrote its output there: describing it copies nothing
    try:
        if decoded is not None:
            batch = decoded
        else:
            good_pos = [p for p, it in enumerate(loaded.items) if not isinstance(it, pipeline.SampleFailure)]
            extra = writer.collate_map(good_pos) if streamed else None
            batch = _collate(plan, good, arena, extra, slots.file(slot))
        desc, needed = shm.describe(batch, arena, slots.file(slot))
    except BaseException:
        slots.give_back(slot, new_storage)  # a collate error: the slot serves the next batch
        raise
    if needed == 0:  # nothing array-like (keys, bytes): the batch itself is the message
        slots.give_back(slot, new_storage)
        return None, None, batch
    if desc is None:
        storage = new_storage = slots.grow(slot, needed + (1 << 16))
        desc, _ = shm.describe(batch, shm.Arena(storage), slots.file(slot))
    return slot, new_storage, desc


def failure(
    ctx: WorkerContext,
    task: Task,
    index: Any,
    key: str | None,
    exc: BaseException,
    doing: str | None = None,
) -> WorkerFailure:
    """A failed task. ``doing``: the batch step that failed; by default loading sample ``index``."""
    # ours travel as themselves (type and failures kept); in-process, the user's exception itself is
    # raised, as by torch's single-process iterator; from a process, torch's wrapper carries it
    own = isinstance(exc, BatchDecodeError) or ctx.plan.in_process
    if doing is None and index is not None:
        doing = f"while loading {pipeline.sample_label(index, key)}"
    error = exc if own else _wrap(exc, ctx.wid, doing)
    return WorkerFailure(task.gen, task.seq, ctx.wid, index, key, error)


def _collated(ctx: WorkerContext, slots: slots_mod.Slots, item: Fetched) -> BatchReady | WorkerFailure:
    """A task whose batch came collated from ``get_batch`` (fetch.py): each of its tensors goes
    into the slot with one write (in-process, the batch itself is the result)."""
    task, timing = item.task, dict(item.timing)
    t1 = time.perf_counter()
    slot, new_storage, payload = None, None, item.batch
    if ctx.plan.use_shm:
        try:
            slot, new_storage, payload = _into_slot(ctx, slots, _Loaded([], timing), [], None, item.batch)
        except Exception as exc:  # noqa: BLE001 - a batch step: named by its batch
            doing = _batch_stage("writing into shared memory", task, task.indices)
            return failure(ctx, task, task.indices[0], None, exc, doing)
    timing["map_s"] = 0.0
    timing["collate_s"] = time.perf_counter() - t1
    return BatchReady(
        gen=task.gen,
        seq=task.seq,
        worker=ctx.wid,
        slot=slot,
        payload=payload,
        good=len(task.indices),
        new_storage=new_storage,
        handover=slot is not None and slots.is_handover(slot),
        failures=(),
        timing=timing,
        cache_stats=None,  # no cache on this path (Read.COLLATED)
        dropped_slots=tuple(slots.take_dropped()) if ctx.plan.use_shm else (),
    )


def process(
    ctx: WorkerContext, slots: slots_mod.Slots, item: Fetched, first: FirstDecode | None = None
) -> BatchReady | WorkerFailure:
    """One task: load its samples, run a worker-side batch decoder, collate into a slot."""
    if item.batch is not None:
        return _collated(ctx, slots, item)
    plan, task = ctx.plan, item.task
    loaded = _load(ctx, slots, item)
    timing = loaded.timing
    t1 = time.perf_counter()
    good, good_idx, bad = pipeline.split_failures(loaded.items, task.indices)
    decoded = alloc = None
    raising = plan.on_error == "raise"
    if plan.batch_decode is not None and good and not (bad and raising):
        if plan.use_shm:  # the decoder's output goes into this slot
            loaded.slot = slots.acquire()
            alloc = slots_mod.SlotAlloc(slots, loaded.slot)
        else:  # made in the main process (inline_first.py): a tensor nobody keeps once dropped
            alloc = _own_tensor
        decode = functools.partial(
            plan.batch_decode.decode_batch, seed=int(task.decode_seed or 0), alloc=alloc
        )
        try:
            if first is None:
                outcome = pipeline.decode_dropping_failures(decode, good, good_idx, plan.on_error)
            else:
                with first.around(task.gen, task.seq):
                    outcome = pipeline.decode_dropping_failures(decode, good, good_idx, plan.on_error)
        except BatchDecodeError as exc:  # on_error="raise": raised as the main process would raise it
            _unused(slots, loaded)
            pos, key, _ = exc.failures[0] if exc.failures else (0, None, None)
            return failure(ctx, task, good_idx[pos], key, exc)
        except Exception as exc:  # noqa: BLE001 - a decoder bug: a batch step, named by its batch
            _unused(slots, loaded)
            doing = _batch_stage("decoding", task, good_idx)
            return failure(ctx, task, good_idx[0], contracts.sample_key(good[0]), exc, doing)
        finally:
            timing["decode_batch_s"] = time.perf_counter() - t1
        decoded, good, good_idx = outcome.batch, outcome.samples, outcome.indices
        bad += outcome.failures
        t1 = time.perf_counter()
    if not good or (bad and raising):
        _unused(slots, loaded)
    if bad and raising:
        f = bad[0]
        return failure(ctx, task, f.index, f.key, f.cause)
    failures = tuple(
        FailedSample(f.index, f.key, f.stage, f"{type(f.cause).__name__}: {f.cause}") for f in bad
    )
    cache_stats = _cache_delta(ctx)
    slot, new_storage, payload = None, None, good
    if not plan.send_raw and good:
        try:
            slot, new_storage, payload = _into_slot(ctx, slots, loaded, good, alloc, decoded)
        except Exception as exc:  # noqa: BLE001 - a collate error: a batch step, named by its batch
            return failure(ctx, task, good_idx[0], None, exc, _batch_stage("collating", task, good_idx))
    timing["collate_s"] = time.perf_counter() - t1
    return BatchReady(
        gen=task.gen,
        seq=task.seq,
        worker=ctx.wid,
        slot=slot,
        payload=payload,
        good=len(good),
        new_storage=new_storage,
        handover=slot is not None and slots.is_handover(slot),
        failures=failures,
        timing=timing,
        cache_stats=cache_stats,
        dropped_slots=tuple(slots.take_dropped()) if plan.use_shm else (),
        indices=tuple(good_idx) if plan.send_raw else (),
    )


def _own_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A decoder's output of its own, not from the decoder's reused buffers: those would keep a
    batch-sized buffer in the main process for the loader's life."""
    return torch.empty(shape, dtype=dtype)


def _unused(slots: slots_mod.Slots, loaded: _Loaded) -> None:
    """The task's slot, if it took one, will not carry its batch."""
    if loaded.slot is not None:
        slots.unused(loaded.slot)
        loaded.slot = None


def _collate(
    plan: WorkerPlan,
    good: list[Any],
    arena: shm.Arena | None,
    extra: dict | None = None,
    file: shm.SlotFile | None = None,
) -> Any:
    """torch's rules: ``collate_fn(list)`` when batching, ``collate_fn(sample)`` with batch_size=None;
    our default collate writes straight into the shared slot."""
    if not plan.auto_collation:
        fn = plan.collate_fn or torch.utils.data.default_convert
        return fn(good[0])
    if plan.collate_fn is not None:
        return plan.collate_fn(good)
    if arena is None:
        return torch.utils.data.default_collate(good)
    return shm.default_collate_into(good, arena, extra, file)


def _map_tracking(
    ctx: WorkerContext, items: list[Any], indices: list[Any], writer: rows.RowWriter | None = None
) -> list[Any]:
    """Map a batch, sample by sample; with ``plan.threads`` > 1 on a thread pool (PIL and most
    decoders release the GIL while they work, so one worker process can keep several cores busy).
    With ``writer`` each finished sample's tensors go straight into their batch row."""
    fn, threads, progress = ctx.plan.map_fn, ctx.plan.threads, ctx.progress

    def one(pos: int, sample: Any, index: Any) -> Any:
        progress[MAP_IDX] = _first([index])
        out = pipeline.apply_map([sample], [index], fn)[0]
        if writer is not None and not isinstance(out, pipeline.SampleFailure):
            out = writer.put(pos, out)
        return out

    if threads > 1 and len(items) > 1:
        if ctx.pool is None:
            ctx.pool = ThreadPoolExecutor(threads, thread_name_prefix="stallfree-decode")
        return list(ctx.pool.map(one, range(len(items)), items, indices))
    return [one(pos, s, i) for pos, (s, i) in enumerate(zip(items, indices, strict=True))]


def _cache_delta(ctx: WorkerContext) -> dict | None:
    """This worker's cache report: counters as gained since its last report (deltas add up across
    workers and epochs), levels (entries, used_bytes) as they are now; ratios are left out (the main
    process recomputes them from the summed counters)."""
    now = _cache_stats(ctx.plan.cache, ctx.read_stats)
    if now is None:
        return None
    last = ctx.cache_baseline or {}
    ctx.cache_baseline = now
    return {
        k: (v - last.get(k, 0)) if k in CACHE_COUNTERS else v for k, v in now.items() if not is_cache_ratio(k)
    }


def _cache_stats(cache: Any, read_stats: Any) -> dict | None:
    """This worker's cache counters: the cache's own numeric stats plus read_through's counts."""
    if cache is None:
        return None
    try:
        stats = dict(cache.stats())
    except Exception:  # noqa: BLE001 - stats are informational
        stats = {}
    if read_stats is not None:
        stats.update({f"read_{k}": v for k, v in read_stats.as_dict().items() if k != "hit_rate"})
    return {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
