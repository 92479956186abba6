"""``stallfree shard --engine ray[:ADDRESS]``: the planned shard tasks as Ray tasks, and
``write_ray`` (``stallfree.shards.write_ray``): a Ray Dataset written as our shards.

Each shard task is one ``ray.remote`` call with retries (``max_retries`` for a dead worker or
node, ``retry_exceptions`` for an error it raised); the job (source, format, destination) goes
into the object store once, each task carries only its items. A task writes its shard under a
temp name renamed into place (``write_shard``), so a retried attempt writes the same bytes under
the same name and never leaves a duplicate or half shard. A data error (``ShardError``) comes
back as the task's outcome, not retried (it fails alike on every attempt). The driver reports
progress as tasks finish and writes the manifest only after all of them succeeded
(``shard_dataset``); on a failure it cancels the rest, waits for them to stop, and the job
removes every planned shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from stallfree.engines.executor import (
    ShardTaskError,
    check_destination_reachable,
    check_reachable,
)
from stallfree.errors import ShardError
from stallfree.extras import require
from stallfree.shards.parallel import ProgressFn, ShardJob, ShardResult, ShardSummary, ShardTask, run_task
from stallfree.shards.write_engines import (
    Destination,
    PartitionPart,
    PartitionWrite,
    commit_parts,
    first_error,
    open_destination,
    remove_run_files,
    write_partition,
)

log = logging.getLogger(__name__)

_WAIT_S = 0.2
_CANCEL_WAIT_S = 30.0


@dataclass(frozen=True)
class TaskOutcome:
    """What one Ray task returns: its shard's result, or the data error that ended it."""

    index: int
    result: ShardResult | None
    error: ShardError | None = None


def shard_task(job: ShardJob, task: ShardTask) -> TaskOutcome:
    """The body of one Ray task (module level: Ray imports it by name on the workers)."""
    try:
        return TaskOutcome(task.index, run_task(job, task))
    except ShardError as exc:  # deterministic: another attempt fails the same way
        return TaskOutcome(task.index, None, exc)


def _ray() -> Any:
    return require("ray", "ray", "stallfree shard --engine ray / write_ray")


class RayExecutor:
    """Runs shard tasks on Ray. ``address``: a cluster to connect to (``auto``: the one this
    machine runs; ``HOST:PORT``; ``ray://HOST:PORT`` through Ray Client); None: the Ray this
    process is already connected to, else a new local one. What this executor connected to it
    disconnects on ``close``. ``max_retries``: attempts after the first for a task that failed."""

    name = "ray"
    remote = True

    def __init__(
        self,
        address: str | None = None,
        *,
        workers: int = 1,
        shared_fs: bool = False,
        max_retries: int = 3,
        num_cpus: float = 1,
        init_options: dict[str, Any] | None = None,
    ) -> None:
        ray = _ray()
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.shared_fs = shared_fs
        self.max_retries = max_retries
        self.num_cpus = num_cpus
        self._owned = False
        if not ray.is_initialized():
            ray.init(address=address, **(init_options or {}))
            self._owned = True
        self.address = address or "connected"

    def nodes(self) -> list[str]:
        """The addresses of the cluster's live nodes (every one may run a task)."""
        return sorted({n["NodeManagerAddress"] for n in _ray().nodes() if n.get("Alive")})

    def prepare(self, job: ShardJob) -> None:
        check_reachable(f"ray ({self.address})", self.nodes(), job, shared_fs=self.shared_fs)

    def run(
        self,
        job: ShardJob,
        tasks: Sequence[ShardTask],
        on_result: Callable[[ShardResult], None],
        progress: ProgressFn | None,
    ) -> None:
        ray = _ray()
        remote = ray.remote(shard_task).options(
            max_retries=self.max_retries,
            retry_exceptions=True,
            num_cpus=self.num_cpus,
            name="stallfree-shard",
        )
        job_ref = ray.put(job)
        pending = [remote.remote(job_ref, task) for task in tasks]
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=_WAIT_S)
                for ref in done:
                    outcome: TaskOutcome = _get(ray, ref, tasks)
                    if outcome.error is not None:
                        raise outcome.error
                    result = outcome.result
                    assert result is not None
                    on_result(result)
                    if progress is not None and result.info is not None:
                        progress(result.info.samples, result.info.bytes)
        except BaseException:
            _cancel(ray, pending)
            raise

    def close(self) -> None:
        if self._owned:
            _ray().shutdown()
            self._owned = False

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _get(ray: Any, ref: Any, tasks: Sequence[ShardTask]) -> Any:
    """The task's outcome; a task that failed after its retries as ``ShardTaskError`` naming
    its error (Ray's own message: the exception and where it was raised)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None)
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc).splitlines()[0]
        raise ShardTaskError(
            f"a shard task failed on Ray after its retries ({len(tasks)} task(s) planned; no manifest "
            f"written, the shards of this run removed): {what}"
        ) from None


def _cancel(ray: Any, pending: list[Any]) -> None:
    """Stop the tasks still running and wait until they have (so none renames a shard into place
    after the job removed this run's shards)."""
    for ref in pending:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - already finished
            pass
    deadline = time.monotonic() + _CANCEL_WAIT_S
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=_WAIT_S)
    if pending:
        log.warning(
            "%d Ray shard task(s) did not stop within %.0f s of the cancel", len(pending), _CANCEL_WAIT_S
        )


# -- write_ray: shards from a Ray Dataset ------------------------------------------------------------
def _datasink_class() -> type:
    from ray.data import Datasink

    class StallfreeDatasink(Datasink):
        """A Ray ``Datasink`` writing stallfree shards: each write task its partition's
        ``part-PPPPP-NNNN`` shards (``write_engines.write_partition``, the task index as the
        partition); on the driver, one manifest once every task succeeded; the run's files
        removed if any failed."""

        def __init__(self, spec: PartitionWrite, dest: Destination) -> None:
            self.spec = spec
            self._dest: Destination | None = dest  # driver only (not sent to the tasks)
            self.summary: ShardSummary | None = None
            self._started = time.perf_counter()

        def __getstate__(self) -> dict[str, Any]:
            state = dict(self.__dict__)
            state["_dest"] = None
            return state

        def write(self, blocks: Iterable[Any], ctx: Any) -> str:
            from ray.data.block import BlockAccessor

            tables = (BlockAccessor.for_block(b).to_arrow() for b in blocks)
            first = next(tables, None)
            batches = [] if first is None else _chain(first, tables)
            schema = None if first is None else first.schema
            try:
                return write_partition(self.spec, ctx.task_idx, batches, schema).dumps()
            except ShardError as exc:  # reported, not retried (it fails alike on every attempt)
                return PartitionPart(ctx.task_idx, None, error=str(exc)).dumps()

        @property
        def supports_distributed_writes(self) -> bool:
            return True

        def on_write_complete(self, write_result: Any) -> None:
            assert self._dest is not None
            parts = [PartitionPart.loads(text) for text in write_result.write_returns]
            bad = first_error(parts)
            if bad is not None:
                remove_run_files(self._dest)
                raise ShardTaskError(f"write task {bad.partition} of the Dataset: {bad.error}")
            self.summary = commit_parts(self._dest, self.spec, parts, self._started, {"writer": "write_ray"})

        def on_write_failed(self, error: Exception) -> None:
            if self._dest is not None:
                remove_run_files(self._dest)

    return StallfreeDatasink


def _chain(first: Any, rest: Iterable[Any]) -> Iterable[Any]:
    yield first
    yield from rest


def write_ray(
    ds: Any,
    dst: str,
    *,
    format: str = "tar",
    max_bytes: int = 256_000_000,
    max_samples: int | None = None,
    overwrite: bool = False,
    on_error: str = "raise",
    shared_fs: bool = False,
    **storage_options: Any,
) -> ShardSummary:
    """Write a Ray Dataset as stallfree shards at ``dst`` (any fsspec URL the cluster's nodes
    reach) with one manifest, through a Ray ``Datasink``: WebDataset-compatible tars + ``.idx``
    (``format="tar"``) or Arrow shards (``"arrow"``), read back by ``open_dataset(dst)``. Each
    write task writes its blocks as ``part-PPPPP-NNNN`` shards; the manifest is committed on the
    driver once every task succeeded; a failed run leaves a dataset already at ``dst``
    (``overwrite=True``) as it was. Columns become fields as in ``write_spark``."""
    _ray()
    spec = PartitionWrite(dst, dict(storage_options), format, max_bytes, max_samples, on_error)
    import ray

    if not ray.is_initialized():
        ray.init()
    nodes = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
    check_destination_reachable("ray", nodes, dst, storage_options, shared_fs=shared_fs)
    dest = open_destination(dst, overwrite=overwrite, storage_options=dict(storage_options))
    sink = _datasink_class()(spec, dest)
    try:
        ds.write_datasink(sink)
    except ShardTaskError:
        raise
    except BaseException as exc:
        remove_run_files(dest)
        inner = getattr(exc, "cause", None)
        if isinstance(inner, ShardError):
            raise inner from None
        raise
    assert sink.summary is not None
    return sink.summary
