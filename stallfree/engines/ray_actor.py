"""One remote worker: a Ray actor that runs a local worker's stages (read, map, batch decode,
collate: ``stallfree/loader/worker/main.py`` ``process``) on the loader's frozen ``WorkerPlan``.

It is the same code as a local worker's, with two differences, both decided here once: the batch
is collated into ordinary memory (the plan runs as ``in_process``: no shared-memory slots, those
are for processes on the trainer's machine) and travels back through Ray (the task's reply) as
arrays (``ray_wire.py``); and a failed batch's error names this worker and its node. Tasks are
the dispatcher's own ``Task`` values (small: indices and seeds), never sample data.

This module does not import Ray: ``ray_workers.py`` wraps :class:`RemoteWorker` with
``ray.remote`` when it places the actors.
"""

from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from stallfree.engines.ray_wire import to_wire
from stallfree.errors import BatchDecodeError
from stallfree.loader import _torch_compat as compat
from stallfree.loader import contracts
from stallfree.loader.messages import BatchReady, Task, WorkerFailure
from stallfree.loader.plan import WorkerPlan
from stallfree.loader.worker import main as worker_main
from stallfree.loader.worker import read as fetch
from stallfree.loader.worker import stages
from stallfree.loader.worker.context import WorkerContext
from stallfree.loader.worker.shards import ConcurrentShards


@dataclass(frozen=True)
class RemoteResult:
    """What a remote worker returns for one task: the worker's message (its batch as wire arrays
    when it is a ``BatchReady``) and what the task cost there."""

    message: BatchReady | WorkerFailure
    node: str  # the node's address
    cpu_s: float  # this process's CPU time for the task (all its threads)
    wall_s: float
    sent_bytes: int  # tensor bytes in the batch


@dataclass(frozen=True)
class NodeInfo:
    address: str
    node_id: str
    hostname: str
    pid: int


class RemoteWorker:
    """The actor's class (see the module docstring). ``wid``: its place among the loader's
    workers (local ones first), for seeds, ``get_worker_info`` and error messages."""

    def __init__(self, wid: int, total_workers: int) -> None:
        self.wid = wid
        self.total = total_workers
        self.ctx: WorkerContext | None = None
        import ray

        rt = ray.get_runtime_context()
        self.info = NodeInfo(
            ray.util.get_node_ip_address(), rt.get_node_id(), socket.gethostname(), os.getpid()
        )
        torch.set_num_threads(1)

    def node(self) -> NodeInfo:
        return self.info

    def start(self, plan: WorkerPlan) -> NodeInfo:
        """Take the loader's plan (once per worker pool): seeds, worker info, ``worker_init_fn``,
        the read source, as a local worker's start does."""
        if self.ctx is not None and self.ctx.source is not None:
            self.ctx.source.close()
        plan = replace(plan, in_process=True, num_workers=self.total)  # no shared slots: plain memory
        ctx = WorkerContext(self.wid, plan, [-1, -1, -1, -1], plan.read_path)
        seed = (plan.base_seed + self.wid) % 2**63
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(compat.worker_numpy_seed(plan.base_seed, self.wid))
        compat.set_worker_info(self.wid, self.total, seed, plan.dataset)
        if plan.worker_init_fn is not None:
            try:
                plan.worker_init_fn(self.wid)
            except Exception as exc:  # noqa: BLE001 - the answer to every task, as in torch
                ctx.init_error = compat.wrap_exception(exc, self._where("in worker_init_fn"))
        if isinstance(plan.batch_decode, contracts.ThreadedDecoder):
            plan.batch_decode.use_threads(plan.threads)
        ctx.source = ConcurrentShards(plan.dataset, staging=plan.staging) if ctx.path.concurrent else None
        if plan.cache is not None:
            from stallfree.cache.readthrough import ReadStats

            ctx.read_stats = ReadStats()
        self.ctx = ctx
        return self.info

    def run(self, task: Task) -> RemoteResult:
        """One task through the worker's stages; its batch as wire arrays."""
        t0, c0 = time.perf_counter(), time.process_time()
        msg = self._process(task)
        sent = 0
        if isinstance(msg, BatchReady):
            payload, sent = to_wire(msg.payload)
            msg = replace(msg, payload=payload)
        return RemoteResult(msg, self.info.address, time.process_time() - c0, time.perf_counter() - t0, sent)

    def _process(self, task: Task) -> BatchReady | WorkerFailure:
        ctx = self.ctx
        if ctx is None:
            raise RuntimeError("remote worker used before start()")
        if ctx.init_error is not None:
            return WorkerFailure(task.gen, task.seq, self.wid, None, None, ctx.init_error)
        try:
            item = fetch.fetch_task(ctx, task)
            msg = worker_main.process(ctx, None, item)  # type: ignore[arg-type] - no slots in plain memory
        except Exception as exc:  # noqa: BLE001 - a bug in a stage: named by its batch
            first = task.indices[0] if task.indices else None
            doing = f"while loading batch {task.seq} ({len(task.indices)} samples, first index {first})"
            return WorkerFailure(
                task.gen, task.seq, self.wid, first, None, compat.wrap_exception(exc, self._where(doing))
            )
        # our own BatchDecodeError travels as itself (its pickle keeps only its failures: the
        # trainer adds the node to it, ray_pool.py); the user's exception is wrapped here
        if isinstance(msg, WorkerFailure) and not isinstance(msg.error, BatchDecodeError):
            # in_process keeps the user's exception itself: wrap it here, naming worker and node
            doing = (
                f"while loading {stages.sample_label(msg.index, msg.key)}" if msg.index is not None else None
            )
            error = msg.error
            if isinstance(error, BaseException):
                error = compat.wrap_exception(error, self._where(doing))
            msg = replace(msg, error=error)
        return msg

    def _where(self, doing: str | None) -> str:
        where = (
            f"in stallfree remote worker {self.wid} on Ray node {self.info.address} ({self.info.hostname})"
        )
        return f"{where} {doing}" if doing else where

    def stop(self) -> None:
        if self.ctx is not None and self.ctx.source is not None:
            self.ctx.source.close()
            self.ctx.source = None
