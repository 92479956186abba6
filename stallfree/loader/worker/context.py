"""A worker's runtime state: what changes while it runs, kept apart from the plan it executes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from stallfree.loader.plan import ReadPath, WorkerPlan


@dataclass
class WorkerContext:
    """One worker's runtime state (the plan it executes never changes)."""

    wid: int
    plan: WorkerPlan
    progress: Any  # shared with the main process: which batch/sample each stage is on (fetch.py)
    path: ReadPath  # the plan's read stage (plan.read_path), chosen once when the worker starts
    source: Any = None  # what the read stage reads: the dataset, or a ConcurrentShards over it
    read_stats: Any = None  # stallfree.cache.readthrough.ReadStats, made in the worker
    cache_baseline: dict | None = None  # cache counters at the worker's last report
    epoch: int | None = None  # the epoch the worker last set on an ordered dataset (a mixture)
    init_error: Any = None  # worker_init_fn's failure: the answer to every task, as in torch
    pool: ThreadPoolExecutor | None = field(default=None, repr=False)  # map threads
