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
from typing import Any

import torch


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
    def reads_inline(self) -> bool:
        """Whether a worker reads its samples itself, one by one, instead of on a fetch thread.

        For a plain map-style dataset (torch's Dataset, decode in ``__getitem__``) there is no raw
        read to overlap with a decode step: a fetch thread would only hold whole batches of decoded
        samples ahead (measured: +35 MiB per worker of 19 MB batches). Read inline, each sample goes
        into its batch row as soon as ``__getitem__`` returns, and only that sample is alive."""
        return (
            not self.in_process
            and self.map_fn is None
            and self.batch_decode is None
            and self.cache is None
            and not self.send_raw
            and self.fetch_threads <= 1
            and not hasattr(self.dataset, "get_many")
        )


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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // max(1, num_workers)))
