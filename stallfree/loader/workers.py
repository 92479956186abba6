"""Worker processes (or, with ``num_workers=0``, one in-process thread) of the fast path.

Each worker reads its batches' samples (fetch.py: ahead on a fetch thread, or inline for a plain
Dataset), decodes/transforms them on its main thread, collates straight into a shared-memory slot
(slots.py, rows.py) and sends a small description to the main process. Errors carry the worker id
and the sample.

``get_worker_info`` is torch's: our workers set torch's worker info, so user code calling
``torch.utils.data.get_worker_info()`` sees the same thing as with torch's DataLoader.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import worker as _torch_worker

from stallfree.loader import fetch, pipeline, rows, shardio, shm
from stallfree.loader import slots as slots_mod
from stallfree.loader.fetch import MAP_IDX, MAP_SEQ
from stallfree.loader.stats import CACHE_COUNTERS, is_cache_ratio
from stallfree.shards.errors import BatchDecodeError

logger = logging.getLogger(__name__)

__all__ = ["get_worker_info", "WorkerSpec", "worker_main"]


def get_worker_info() -> Any:
    """Inside a loader worker: its ``WorkerInfo`` (id, num_workers, seed, dataset); else None."""
    return _torch_worker.get_worker_info()


@dataclass
class WorkerSpec:
    """Everything a worker needs (pickled once per worker under spawn/forkserver)."""

    dataset: Any
    num_workers: int
    collate_fn: Any = None  # None: default collate straight into the slot
    map_fn: Any = None  # per-sample decode/transform
    batch_decode: Any = None  # a decode_batch decoder that runs in the workers (its runs_in_workers)
    cache: Any = None
    stage: str | None = None  # cache stage of map_fn's output (its cache_stage attribute)
    fingerprint: str | None = None
    raw_only: bool = False  # decode_batch mode: send raw sample lists, no map/collate
    on_error: str = "raise"
    worker_init_fn: Any = None
    base_seed: int = 0
    use_shm: bool = True
    max_slots: int = 3
    in_process: bool = False
    auto_collation: bool = True  # False with batch_size=None: one sample per task, collate_fn(sample)
    threads: int = 1  # decode threads in each worker
    fetch_threads: int = 1  # tasks read at once by each worker's fetch thread(s)
    parent_pid: int = field(default_factory=os.getpid)
    start_method: str | None = None  # the workers' multiprocessing start method (set by the engine)
    read_stats: Any = None  # stallfree.cache.readthrough.ReadStats of this worker, made in the worker
    source: Any = None  # what the fetch stage reads: the dataset, or a ConcurrentShards over it (remote)
    cache_baseline: dict | None = None  # cache counters at the worker's last report


def _seed_worker(spec: WorkerSpec, wid: int) -> int:
    seed = (spec.base_seed + wid) % 2**63
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_torch_worker._generate_state(spec.base_seed, wid))
    return seed


def _failure_tuple(f: pipeline.SampleFailure) -> tuple[int, str, str, str]:
    return (f.index, f.key, f.stage, f"{type(f.cause).__name__}: {f.cause}")


def _wrap(exc: BaseException, wid: int, index: int | None, key: str | None) -> ExceptionWrapper:
    where = f"in DataLoader worker process {wid}"
    if index is not None:
        where += f" while loading sample {index} (key {key!r})"
    return ExceptionWrapper(exc_info=(type(exc), exc, exc.__traceback__), where=where)


def worker_main(wid: int, spec: WorkerSpec, task_q: Any, free_q: Any, result_q: Any, progress: Any) -> None:
    """Entry point of one worker (a process, or a thread when ``spec.in_process``)."""
    if not spec.in_process:
        if not faulthandler.is_enabled():  # a crash in native code (a decoder) leaves a Python stack
            with contextlib.suppress(Exception):
                faulthandler.enable()
        torch.set_num_threads(1)
        seed = _seed_worker(spec, wid)
        _torch_worker._worker_info = _torch_worker.WorkerInfo(
            id=wid, num_workers=spec.num_workers, seed=seed, dataset=spec.dataset
        )
        if spec.worker_init_fn is not None:
            try:
                spec.worker_init_fn(wid)
            except Exception as exc:  # noqa: BLE001 - reported to the main process
                result_q.put(("error", -1, -1, wid, None, None, _wrap(exc, wid, None, None)))
                return
    if spec.batch_decode is not None and hasattr(spec.batch_decode, "use_threads"):
        spec.batch_decode.use_threads(spec.threads)  # this worker's share of the cores
    if shardio.wants_concurrency(spec.dataset):
        spec.source = shardio.ConcurrentShards(spec.dataset)
    if spec.cache is not None:
        from stallfree.cache.readthrough import ReadStats

        spec.read_stats = ReadStats()
        spec.cache_baseline = _cache_stats(spec.cache, spec.read_stats)
    stop = threading.Event()
    ready: queue.Queue = queue.Queue(maxsize=2)
    reader = None
    if fetch.reads_inline(spec):
        tasks: Iterator[tuple] = fetch.inline_tasks(spec, task_q)
    else:
        reader = threading.Thread(
            target=fetch.reader_loop,
            args=(spec, task_q, ready, stop, progress),
            daemon=True,
            name=f"fetch-{wid}",
        )
        reader.start()
        tasks = iter(ready.get, None)
    slots = slots_mod.Slots(spec.max_slots, free_q)
    try:
        for item in tasks:
            gen, seq, indices, items, timing, mapped, seed = item
            progress[MAP_SEQ], progress[MAP_IDX] = seq, indices[0] if indices else -1
            msg = _process(spec, wid, slots, gen, seq, indices, items, timing, mapped, progress, seed)
            progress[MAP_SEQ], progress[MAP_IDX] = -1, -1
            result_q.put(msg)
            if msg[0] == "batch" and msg[4] is not None:  # the slot is the main process's until it returns
                shm.release_pages(slots.storages[msg[4]])
    except KeyboardInterrupt:
        return
    finally:
        stop.set()
        if reader is not None:
            with contextlib.suppress(queue.Empty):  # a reader blocked on the full queue sees stop next
                while True:
                    ready.get_nowait()
            reader.join(timeout=2.0)  # let it finish its read before its source closes under it
        if spec.source is not None:
            spec.source.close()
            spec.source = None


def _row_writer(slots: slots_mod.Slots, n: int) -> tuple[int, rows.RowWriter]:
    """A slot for the next batch and the writer that puts its samples' rows into it."""
    slot = slots.acquire()
    return slot, rows.RowWriter(
        n, functools.partial(slots.reserve, slot), functools.partial(slots.file, slot)
    )


def _load(spec, slots, seq, indices, items, mapped, progress, timing) -> tuple:
    """Read (inline tasks) or decode/transform (``decode=``) a task's samples, each going into its
    batch row as it is ready where the default collate applies. Returns (items, timing, slot,
    writer); slot and writer are None when nothing was streamed."""
    t0 = time.perf_counter()
    writer = slot = None
    map_s = 0.0
    streams = spec.use_shm and spec.auto_collation and spec.collate_fn is None
    if items is None:  # an inline task (fetch.reads_inline): read here, straight into the rows
        if streams:
            slot, writer = _row_writer(slots, len(indices))
        items = fetch.fetch_streaming(spec, seq, indices, progress, writer)
        timing = dict(timing, fetch_s=time.perf_counter() - t0)
    elif not mapped and not spec.raw_only and spec.map_fn is not None:
        if streams:
            slot, writer = _row_writer(slots, len(items))
        items = _map_tracking(items, indices, spec.map_fn, progress, spec.threads, writer)
        map_s = time.perf_counter() - t0
    timing = dict(timing, map_s=timing.get("map_s", 0.0) + map_s)
    if writer is not None:
        items = writer.final(items)
    return items, timing, slot, writer


def _into_slot(spec, slots, slot, items, good, writer, alloc, decoded) -> tuple[int | None, Any, Any]:
    """Collate the good samples (unless decoded already) and describe the batch in its slot.

    Returns (slot, storage to announce, message payload); slot None when the payload is the batch
    itself (nothing array-like in it, or no shared memory)."""
    if not spec.use_shm:
        return None, None, _collate(spec, good, None)
    if slot is None:
        slot = slots.acquire()
    storage = slots.storages[slot]
    new_storage = slots.announce(slot)
    streamed = writer is not None and writer.active and writer.arena is not None
    arena = writer.arena if streamed else shm.Arena(storage)
    if alloc is not None and alloc.arena is not None:
        arena = alloc.arena  # the decoder wrote its output there: describing it copies nothing
    if decoded is not None:
        batch = decoded
    else:
        good_pos = [pos for pos, it in enumerate(items) if not isinstance(it, pipeline.SampleFailure)]
        extra = writer.collate_map(good_pos) if streamed else None
        batch = _collate(spec, good, arena, extra, slots.file(slot))
    desc, needed = shm.describe(batch, arena, slots.file(slot))
    if needed == 0:  # nothing array-like (keys, bytes): the batch itself is the message
        slots.give_back(slot, new_storage)
        return None, None, batch
    if desc is None:
        storage = new_storage = slots.grow(slot, needed + (1 << 16))
        desc, _ = shm.describe(batch, shm.Arena(storage), slots.file(slot))
    return slot, new_storage, desc


def _process(spec, wid, slots, gen, seq, indices, items, timing, mapped, progress, seed=None) -> tuple:
    """One task: load its samples, run a worker-side batch decoder, collate into a slot; the
    message for the main process ("batch" or "error", naming the worker and sample)."""
    items, timing, slot, writer = _load(spec, slots, seq, indices, items, mapped, progress, timing)
    t1 = time.perf_counter()
    good, good_idx, bad = pipeline.split_failures(items, indices)
    decoded = alloc = None
    if spec.batch_decode is not None and good and not (bad and spec.on_error == "raise"):
        slot = slots.acquire()
        alloc = slots_mod.SlotAlloc(slots, slot)
        try:
            decoded, good, good_idx, more = _decode_batch(spec, good, good_idx, seed, alloc)
        except BatchDecodeError as exc:  # on_error="raise": the error as the main process would raise it
            slots.free.append(slot)
            return ("error", gen, seq, wid, good_idx[exc.failures[0][0]], exc.failures[0][1], exc)
        except Exception as exc:  # noqa: BLE001 - a decoder bug: reported with the batch's first sample
            slots.free.append(slot)
            key = pipeline.sample_key(good[0], good_idx[0])
            return ("error", gen, seq, wid, good_idx[0], key, _wrap(exc, wid, good_idx[0], key))
        finally:
            timing = dict(timing, decode_batch_s=time.perf_counter() - t1)
        bad += more
        t1 = time.perf_counter()
    if slot is not None and (not good or (bad and spec.on_error == "raise")):
        slots.free.append(slot)
        slot = None
    if bad and spec.on_error == "raise":
        f = bad[0]
        return ("error", gen, seq, wid, f.index, f.key, _wrap(f.cause, wid, f.index, f.key))
    failures = [_failure_tuple(f) for f in bad]
    cache_stats = _cache_delta(spec)
    new_storage, payload = None, good
    if not spec.raw_only and good:
        try:
            slot, new_storage, payload = _into_slot(spec, slots, slot, items, good, writer, alloc, decoded)
        except Exception as exc:  # noqa: BLE001 - a collate error names the batch's first sample
            key = pipeline.sample_key(good[0], good_idx[0])
            return ("error", gen, seq, wid, good_idx[0], key, _wrap(exc, wid, good_idx[0], None))
    else:
        slot = None
    timing["collate_s"] = time.perf_counter() - t1
    dropped = slots.take_dropped() if spec.use_shm else []
    return (
        "batch",
        gen,
        seq,
        wid,
        slot,
        new_storage,
        payload,
        failures,
        timing,
        cache_stats,
        len(good),
        dropped,
    )


def _decode_batch(
    spec: WorkerSpec, good: list, good_idx: list[int], seed: int | None, alloc: slots_mod.SlotAlloc
) -> tuple:
    """Run the batch decoder in this worker; with on_error skip/warn, drop the samples it names and
    decode the rest again (as the main process does for decoders that run there).

    Returns (batch or None, samples kept, their indices, failures); raises BatchDecodeError
    under on_error="raise"."""
    failures: list[pipeline.SampleFailure] = []
    while good:
        try:
            return (
                spec.batch_decode.decode_batch(good, seed=int(seed or 0), alloc=alloc),
                good,
                good_idx,
                failures,
            )
        except BatchDecodeError as exc:
            if spec.on_error == "raise" or not exc.failures:
                raise
            bad = {pos for pos, _, _ in exc.failures}
            failures += [
                pipeline.SampleFailure(good_idx[pos], key, "decode_batch", cause)
                for pos, key, cause in exc.failures
            ]
            good = [s for p, s in enumerate(good) if p not in bad]
            good_idx = [i for p, i in enumerate(good_idx) if p not in bad]
    return None, [], [], failures


_POOL: ThreadPoolExecutor | None = None


def _collate(
    spec: WorkerSpec,
    good: list[Any],
    arena: shm.Arena | None,
    extra: dict | None = None,
    file: shm.SlotFile | None = None,
) -> Any:
    """torch's rules: ``collate_fn(list)`` when batching, ``collate_fn(sample)`` with batch_size=None;
    our default collate writes straight into the shared slot."""
    if not spec.auto_collation:
        return spec.collate_fn(good[0])
    if spec.collate_fn is not None:
        return spec.collate_fn(good)
    if arena is None:
        return torch.utils.data.default_collate(good)
    return shm.default_collate_into(good, arena, extra, file)


def _map_tracking(
    items, indices, fn, progress, threads: int = 1, writer: rows.RowWriter | None = None
) -> list[Any]:
    """Map a batch, sample by sample; with ``threads`` > 1 on a thread pool (PIL and most
    decoders release the GIL while they work, so one worker process can keep several cores busy).
    With ``writer`` each finished sample's tensors go straight into their batch row."""
    global _POOL

    def one(pos: int, sample: Any, index: int) -> Any:
        progress[MAP_IDX] = int(index)
        out = pipeline.apply_map([sample], [index], fn)[0]
        if writer is not None and not isinstance(out, pipeline.SampleFailure):
            out = writer.put(pos, out)
        return out

    if threads > 1 and len(items) > 1:
        if _POOL is None or _POOL._max_workers != threads:
            _POOL = ThreadPoolExecutor(threads, thread_name_prefix="stallfree-decode")
        return list(_POOL.map(one, range(len(items)), items, indices))
    return [one(pos, s, i) for pos, (s, i) in enumerate(zip(items, indices, strict=True))]


def _cache_delta(spec: WorkerSpec) -> dict | None:
    """This worker's cache report: counters as gained since its last report (deltas add up across
    workers and epochs), levels (entries, used_bytes) as they are now; ratios are left out (the main
    process recomputes them from the summed counters)."""
    now = _cache_stats(spec.cache, spec.read_stats)
    if now is None:
        return None
    last = spec.cache_baseline or {}
    spec.cache_baseline = now
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
