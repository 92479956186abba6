"""The loader's plan: which stages run where, chosen once per worker pool from the arguments.

A worker runs, per task: read (the dataset, through the cache when given; ahead on a fetch thread
or inline), map (a per-sample ``decode``/transform, optionally through a stage cache), batch decode
(a decoder that says ``runs_in_workers``), collate into a shared-memory slot. The main process
runs, per batch: materialise (views of the slot, or pinned copies), batch decode (a decoder that
must stay with the device), device copy. :class:`WorkerPlan` and :class:`MainPlan` are frozen: no
stage is re-decided per batch, and a worker's runtime state lives in its own context
(``workers.WorkerContext``), never here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from stallfree.loader import contracts


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker does (pickled once per worker under spawn/forkserver)."""

    dataset: Any
    num_workers: int
    collate_fn: Any = None  # None: default collate straight into the slot
    auto_collation: bool = True  # False with batch_size=None: one index per task, collate_fn(sample)
    map_fn: Any = None  # per-sample decode/transform
    batch_decode: Any = None  # a batch decoder run in the workers (it says runs_in_workers)
    send_raw: bool = False  # the main process decodes whole batches: send raw samples, no map/collate
    cache: Any = None
    cache_stage: str | None = None  # cache map_fn's output under this stage (its cache_stage attribute)
    fingerprint: str | None = None
    on_error: str = "raise"
    worker_init_fn: Any = None
    base_seed: int = 0
    max_slots: int = 3
    threads: int = 1  # threads per worker running map_fn
    fetch_threads: int = 1  # tasks each worker's fetch thread reads at once
    staging: Any = None  # shards.staging.Staging: stage whole shards node-locally (block order, remote)
    in_process: bool = False  # num_workers=0: one thread of the main process
    start_method: str | None = None
    parent_pid: int = 0
    forked_by_main_thread: bool = False  # the pool was started from the main thread (lifeline.py)

    @property
    def use_shm(self) -> bool:
        """Batches travel through shared slots (not for the in-process worker: same memory)."""
        return not self.in_process

    @property
    def stage_cached(self) -> bool:
        """Mapped samples are cached (hits skip both the read and the map)."""
        return self.cache_stage is not None and self.cache is not None and not self.send_raw

    @property
    def maps_samples(self) -> bool:
        return self.map_fn is not None and not self.send_raw

    @property
    def streams_rows(self) -> bool:
        """Each ready sample's tensors go straight into its batch row (our default collate only)."""
        return self.use_shm and self.auto_collation and self.collate_fn is None

    @property
    def read_path(self) -> ReadPath:
        return read_path(self)


class Where(str, Enum):
    """Which thread of a worker reads a task."""

    INLINE = "inline"  # the worker's main thread, sample by sample, each straight into its row
    MAIN = "main"  # the worker's main thread, one task at a time, then map and collate
    AHEAD = "ahead"  # a fetch thread, the worker's next tasks ahead of its main thread
    POOLED = "pooled"  # a fetch thread with ``fetch_threads`` tasks read at once (remote latency)


class Read(str, Enum):
    """How one task's samples are read (fetch.py maps each to its function)."""

    STREAMED = "streamed"  # dataset[i] one by one, each into its batch row (Where.INLINE)
    GETITEMS = "getitems"  # torch's __getitems__, once per batch (Where.INLINE)
    COLLATED = "collated"  # get_batch: the collated batch in one call; per sample if it raises
    STAGE_CACHED = "stage_cached"  # decoded samples from the cache; misses read, mapped and stored
    BATCHED = "batched"  # pipeline.fetch: read_through the cache, get_many or __getitems__
    PER_SAMPLE = "per_sample"  # dataset[i] one by one (a __getitems__ torch would not call)


@dataclass(frozen=True)
class ReadPath:
    """A worker's read stage, chosen once per pool (:func:`read_path`), never per batch."""

    where: Where
    read: Read
    concurrent: bool = False  # a remote sharded dataset: its shards opened and read concurrently
    warm_ahead: bool = False  # open the shards of queued tasks before their turn (Where.AHEAD)


def read_path(plan: WorkerPlan) -> ReadPath:
    """The read stage for ``plan``: the one place it is chosen (before: five places).

    - A plain map-style dataset in worker processes (no decode, cache or batched reads of ours)
      is read inline: there is no raw read to overlap with a decode step, and a fetch thread
      would only hold whole batches of decoded samples ahead (measured: +35 MiB per worker of
      19 MB batches). Each sample goes into its row as soon as ``__getitem__`` returns; a
      ``__getitems__`` torch would call is called once per batch instead.
    - A collated ``get_batch`` with nothing after it but the default collate is read on the
      worker's main thread: read and write are one short step, and a fetch thread ahead would
      add a thread hand-over per batch and win no overlap (with ``fetch_threads`` > 1 the pool
      still calls it).
    - Otherwise a fetch thread reads ahead, several tasks at once with ``fetch_threads`` > 1.
    """
    ds = plan.dataset
    torch_batches = plan.auto_collation and contracts.getitems_of(ds) is not None  # torch calls it
    plain = plan.map_fn is None and plan.batch_decode is None and plan.cache is None and not plan.send_raw
    if plain and not plan.in_process and plan.fetch_threads <= 1 and not contracts.reads_batches(ds):
        return ReadPath(Where.INLINE, Read.GETITEMS if torch_batches else Read.STREAMED)
    if (
        plain
        and plan.auto_collation
        and plan.collate_fn is None
        and contracts.collated_read_of(ds) is not None
    ):
        read = Read.COLLATED
    elif plan.stage_cached:
        read = Read.STAGE_CACHED
    elif plan.cache is None and contracts.defines_getitems(ds) and not torch_batches:
        read = Read.PER_SAMPLE  # torch reads dataset[index] then, never __getitems__
    else:
        read = Read.BATCHED
    concurrent = contracts.wants_concurrency(ds)
    if plan.fetch_threads > 1:
        return ReadPath(Where.POOLED, read, concurrent)
    if read is Read.COLLATED:
        return ReadPath(Where.MAIN, read, concurrent)
    # not with a cache: hits need no shard (opening one costs requests)
    return ReadPath(Where.AHEAD, read, concurrent, warm_ahead=concurrent and plan.cache is None)


@dataclass(frozen=True)
class MainPlan:
    """What the main process does with each batch, and how it paces and polices the workers."""

    depth: int  # batches between dispatch and the consumer (prefetch_factor x workers)
    prefetch_factor: int
    in_order: bool
    pin_memory: bool
    device: torch.device | None
    decode_batch: Any  # a batch decoder run here (None: none, or it runs in the workers)
    worker_decode: bool  # the workers run the batch decoder: tasks carry the batch's seed
    finish: Any  # batch -> batch after the device copy, on its stream (uint8 -> float); None: none
    on_error: str
    budget: int | None  # failures allowed this epoch (None: no limit / on_error="raise")
    timeout: float  # torch's ``timeout``: the longest wait for one batch (0: none)
    worker_timeout: float | None  # seconds a worker may spend on one batch before it counts as hung


def worker_cores(num_workers: int) -> int:
    """The cores each worker may use for its decode threads (1 to 4)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity mask
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // max(1, num_workers)))
