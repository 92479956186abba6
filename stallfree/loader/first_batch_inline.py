"""The pool's first batch, made by the main process before any worker starts.

Measured on the image peer bench (4,000 JPEGs, batch 64, 2 workers on 2 shared cores, a 700 MiB
parent: ``benchmarks/bench_startup.py``), the first batch of a fresh pool waited ~27 ms before its
decode began: the fork of a large process (~6 ms), the child's start-up (~7 ms: multiprocessing's
bootstrap, seeding, torch's worker info) and the read of 64 samples whose shards the worker opened
for the first time (~11 ms, half of it parsing their ``.idx``). DALI, which starts threads and no
processes, began decoding at once.

So where nothing the user wrote would run earlier or elsewhere than under torch's DataLoader,
the main process reads and decodes the pool's first task itself, on every core, and the workers
fork after it (``Engine``): the batch is ready by the time they would have begun decoding it, and
they inherit the shards it opened (their indexes already parsed). The decoder's threads are
stopped before the fork, so no worker inherits a pool whose threads it does not have.

Only where this cannot change what the user sees (:func:`runs_inline`): one of our sharded
datasets on the local filesystem (its reads have no side effects and are safe to share across a
fork), our CPU batch decoder (its threads restart on demand), no ``worker_init_fn`` (which could
set up the dataset for a worker), no cache (its environment is opened per process) and no
per-sample map. The batch is the same, byte for byte, as a worker's: the same read, the same
decode with the task's seed (tests/loader/test_inline_first.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from stallfree.loader import contracts
from stallfree.loader.messages import BatchReady, Task, WorkerFailure
from stallfree.loader.plan import Read, WorkerPlan
from stallfree.loader.shm.returns import SlotReturns
from stallfree.loader.shm.slots import Slots
from stallfree.loader.worker import main as workers
from stallfree.loader.worker import read as fetch
from stallfree.loader.worker.context import WorkerContext
from stallfree.loader.worker.first_batch_gate import available_cores, lead_threads


def runs_inline(plan: WorkerPlan) -> bool:
    """Whether the main process may make this pool's first batch itself (see the module docstring)."""
    ds, path = plan.dataset, plan.read_path
    return (
        not plan.in_process
        and plan.num_workers > 0
        and isinstance(plan.batch_decode, contracts.RestartsThreads)
        and bool(plan.batch_decode.restarts_threads)
        and plan.map_fn is None
        and not plan.send_raw
        and plan.worker_init_fn is None
        and plan.cache is None
        and plan.staging is None
        and path.read is Read.BATCHED
        and not path.concurrent
        and contracts.is_sharded(ds)
        and not contracts.orders_itself(ds)
        and not _remote(ds)
    )


def _remote(dataset: Any) -> bool:
    try:
        return contracts.is_remote(dataset)
    except Exception:  # noqa: BLE001 - an unreachable store: not ours to read here
        return True


def run(plan: WorkerPlan, task: Task, cores: int | None = None) -> BatchReady | WorkerFailure:
    """Read and decode ``task`` here, as worker 0 would (the message it would send, the batch in
    it rather than in a shared slot), on ``lead_threads`` of the cores; the decoder's threads are
    gone when this returns."""
    inline = replace(plan, in_process=True)
    ctx = WorkerContext(0, inline, [-1, -1, -1, -1], inline.read_path)
    decoder = plan.batch_decode
    cores = available_cores() if cores is None else cores
    decoder.use_threads(lead_threads(plan.threads, plan.num_workers, cores))
    try:
        try:
            item = fetch.fetch_task(ctx, task)
        except Exception as exc:  # noqa: BLE001 - answered as a worker answers a failed read
            first = task.indices[0] if task.indices else None
            return workers.failure(ctx, task, first, None, exc, f"while reading batch {task.seq}")
        return workers.process(ctx, Slots(1, SlotReturns()), item)
    finally:
        decoder.use_threads(plan.threads)
        decoder.close()  # its threads stop: nothing forks with them; the next decode starts them
