"""``stallfree shard --engine spark[:MASTER]``: the planned shard tasks as one Spark job.

The plan is an RDD with one shard task per partition; each Spark task writes its shard (temp
name, renamed into place: ``write_shard``) and returns a small typed outcome. Spark retries a
task that raised (``spark.task.maxFailures``), so a crash, a lost executor or an I/O error gets
another attempt; an attempt writes the same bytes under the same final name, so a retried or
speculative one never leaves a duplicate or a half shard. A data error (``ShardError``: an
unreadable sample under ``--on-error raise``) is not retried: it would fail the same way, so it
comes back as the outcome and the driver raises it. The driver writes the manifest only after
every task succeeded (``shard_dataset``). Progress (tasks and bytes) comes from a Spark
accumulator polled on the driver while the job runs.

``write_spark`` (``stallfree.shards.write_spark``) writes shards from a DataFrame's own rows:
``stallfree/shards/write_engines.py`` does the writing, this module the Spark side.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from stallfree.engines.executor import (
    ShardTaskError,
    check_destination_reachable,
    check_reachable,
    is_this_machine,
)
from stallfree.errors import ShardError
from stallfree.extras import require
from stallfree.shards.parallel import ProgressFn, ShardJob, ShardResult, ShardSummary, ShardTask, run_task
from stallfree.shards.write_engines import (
    PartitionPart,
    PartitionWrite,
    commit_parts,
    first_error,
    open_destination,
    remove_run_files,
    write_partition,
)

log = logging.getLogger(__name__)

_POLL_S = 0.2
_STOP_WAIT_S = 30.0
_NO_NODES = "<no executor registered yet>"  # not this machine: local paths are refused


@dataclass(frozen=True)
class TaskOutcome:
    """What one Spark task sends back: its shard's result, or the data error that ended it."""

    index: int
    result: ShardResult | None
    error: ShardError | None = None


class _PairSum:
    """Accumulator of (samples, bytes) written by finished tasks (Spark merges only successful
    attempts' updates, so a retried task is counted once)."""

    def zero(self, value: tuple[int, int]) -> tuple[int, int]:
        return (0, 0)

    def addInPlace(self, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:  # noqa: N802 - Spark's name
        return (a[0] + b[0], a[1] + b[1])


def _run_partition(job: ShardJob, written: Any) -> Callable[[Iterator[ShardTask]], Iterator[TaskOutcome]]:
    def run(tasks: Iterator[ShardTask]) -> Iterator[TaskOutcome]:
        for task in tasks:
            try:
                result = run_task(job, task)
            except ShardError as exc:  # deterministic: another attempt fails the same way
                yield TaskOutcome(task.index, None, exc)
                continue
            if result.info is not None:
                written.add((result.info.samples, result.info.bytes))
            yield TaskOutcome(task.index, result)

    return run


def _is_local_master(master: str) -> bool:
    """``local``, ``local[N]``, ``local[N,F]``, ``local-cluster[...]``: every executor is a
    process of this machine."""
    return master == "local" or master.startswith(("local[", "local-cluster["))


def use_this_python(spark: Any) -> None:
    """On a local master, run the Python workers with this interpreter. pyspark starts them with
    PYSPARK_PYTHON, else ``python3`` from PATH: in a virtual environment that is another Python,
    which cannot import stallfree. Left alone when PYSPARK_PYTHON chose one, or on a cluster
    (whose nodes have their own Python)."""
    sc = spark.sparkContext
    if _is_local_master(sc.master) and sc.pythonExec == "python3":
        sc.pythonExec = sys.executable


class SparkExecutor:
    """Runs shard tasks on Spark. ``master``: a Spark master URL (a session is made and stopped by
    ``close``), or None for the active session (``SparkSession.getActiveSession()``), else a new
    ``local[*]`` one. ``spark``: a session to use (never stopped here). ``shared_fs``: local paths
    are on a filesystem every node mounts at the same path."""

    name = "spark"
    remote = True

    def __init__(
        self,
        master: str | None = None,
        *,
        workers: int = 1,
        spark: Any = None,
        shared_fs: bool = False,
        conf: dict[str, str] | None = None,
    ) -> None:
        require("pyspark", "spark", "stallfree shard --engine spark")
        from pyspark.sql import SparkSession

        self.shared_fs = shared_fs
        self._owned = False
        if spark is None and master is None:
            spark = SparkSession.getActiveSession()
        if spark is None:
            builder = SparkSession.builder.master(master or "local[*]").appName("stallfree shard")
            if _is_local_master(master or "local[*]"):
                builder = builder.config("spark.driver.host", "127.0.0.1").config(
                    "spark.driver.bindAddress", "127.0.0.1"
                )
            builder = builder.config("spark.ui.showConsoleProgress", "false")
            for key, value in (conf or {}).items():
                builder = builder.config(key, value)
            spark = builder.getOrCreate()
            self._owned = True
        use_this_python(spark)
        self.spark = spark
        self.master = spark.sparkContext.master

    # -- where tasks run ---------------------------------------------------------------------------
    def nodes(self) -> list[str]:
        """The hosts tasks run on: this machine for a local master; else the executors Spark
        has registered (none yet: a placeholder that is not this machine)."""
        if _is_local_master(self.master):
            return ["127.0.0.1"]
        infos = self.spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
        hosts = sorted({info.host() for info in infos})
        return hosts if len(hosts) > 1 or (hosts and not is_this_machine(hosts[0])) else [*hosts, _NO_NODES]

    def prepare(self, job: ShardJob) -> None:
        check_reachable(f"spark ({self.master})", self.nodes(), job, shared_fs=self.shared_fs)

    # -- the job -----------------------------------------------------------------------------------
    def run(
        self,
        job: ShardJob,
        tasks: Sequence[ShardTask],
        on_result: Callable[[ShardResult], None],
        progress: ProgressFn | None,
    ) -> None:
        if not tasks:
            return
        sc = self.spark.sparkContext
        written = sc.accumulator((0, 0), _PairSum())
        rdd = sc.parallelize(list(tasks), len(tasks)).mapPartitions(_run_partition(job, written))
        group = f"stallfree-shard-{uuid.uuid4().hex[:12]}"
        box: dict[str, Any] = {}

        def collect() -> None:
            sc.setJobGroup(group, f"stallfree shard: {len(tasks)} shard(s) to {job.dst}", True)
            try:
                box["outcomes"] = rdd.collect()
            except BaseException as exc:  # noqa: BLE001 - handed to the driver thread
                box["error"] = exc

        from pyspark import InheritableThread

        thread = InheritableThread(target=collect, name="stallfree-spark-collect", daemon=True)
        thread.start()
        reported = (0, 0)
        try:
            while thread.is_alive():
                thread.join(_POLL_S)
                reported = _report(written.value, reported, progress)
        except BaseException:
            sc.cancelJobGroup(group)
            thread.join(_STOP_WAIT_S)
            _wait_for_tasks_to_stop(sc, group)
            raise
        _report(written.value, reported, progress)
        if "error" in box:
            _wait_for_tasks_to_stop(sc, group)
            raise _task_error(box["error"], tasks) from None
        outcomes: list[TaskOutcome] = box["outcomes"]
        error = next((o for o in outcomes if o.error is not None), None)
        for outcome in outcomes:
            if outcome.result is not None:
                on_result(outcome.result)
        if error is not None:
            raise error.error  # type: ignore[misc]

    def close(self) -> None:
        if self._owned:
            self.spark.stop()
            self._owned = False

    def __enter__(self) -> SparkExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_for_tasks_to_stop(sc: Any, group: str) -> None:
    """After a failed job, wait until none of its task attempts still runs (Spark kills them
    asynchronously), so none renames a shard into place after the run removed its shards."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + _STOP_WAIT_S
    while time.monotonic() < deadline:
        active = 0
        for job_id in tracker.getJobIdsForGroup(group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id)
                active += stage.numActiveTasks if stage is not None else 0
        if active == 0:
            return
        time.sleep(_POLL_S)
    log.warning("Spark tasks of %s still ran %.0f s after the job failed", group, _STOP_WAIT_S)


def _report(
    value: tuple[int, int], reported: tuple[int, int], progress: ProgressFn | None
) -> tuple[int, int]:
    if progress is not None and value != reported:
        progress(value[0] - reported[0], value[1] - reported[1])
    return value


def _task_error(exc: BaseException, tasks: Sequence[ShardTask]) -> BaseException:
    """A failed Spark job as a ``ShardTaskError``: the Python error of the last attempt (the last
    line of the worker's traceback), not the JVM's pages of stack."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    cause = next(
        (ln for ln in reversed(lines) if _looks_like_python_error(ln)), lines[0] if lines else repr(exc)
    )
    planned = f"{len(tasks)} task(s) planned; " if tasks else ""
    return ShardTaskError(
        f"a shard task failed on Spark after its retries ({planned}no manifest written, the shards "
        f"of this run removed): {cause}"
    )


def _looks_like_python_error(line: str) -> bool:
    head = line.split(":", 1)[0]
    return (
        head.replace(".", "").replace("_", "").isalnum()
        and head[:1].isupper()
        and (head.endswith(("Error", "Exception", "Exit", "Interrupt")) or "." in head)
    )


# -- write_spark: shards from a DataFrame's own rows ------------------------------------------------
def write_spark(
    df: Any,
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
    """Write a Spark DataFrame as stallfree shards at ``dst`` (any fsspec URL the executors
    reach) with one manifest: WebDataset-compatible tars + ``.idx`` (``format="tar"``) or Arrow
    IPC shards (``"arrow"``), read back by ``open_dataset(dst)``. Each partition writes its own
    shards (``part-PPPPP-NNNN``) in a Spark task (``mapInArrow``; Spark retries a failed one); the
    manifest is written on the driver once every partition has succeeded, and a failed run
    leaves a dataset already at ``dst`` (``overwrite=True``) as it was. Columns become fields:
    binary columns as their bytes; ``__key__`` or ``key`` names each sample, else
    partition-row. The output depends on the DataFrame's partitions and their row order: the
    same DataFrame gives the same bytes."""
    require("pyspark", "spark", "stallfree.shards.write_spark")
    import pyarrow as pa

    spec = PartitionWrite(dst, dict(storage_options), format, max_bytes, max_samples, on_error)
    spark = df.sparkSession
    master = spark.sparkContext.master
    use_this_python(spark)
    nodes = SparkExecutor(spark=spark).nodes()
    check_destination_reachable(f"spark ({master})", nodes, dst, storage_options, shared_fs=shared_fs)
    started = time.perf_counter()
    dest = open_destination(dst, overwrite=overwrite, storage_options=dict(storage_options))

    def write(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        first = next(batches, None)
        rows = [] if first is None else itertools.chain([first], batches)
        try:
            part = write_partition(spec, partition, rows, None if first is None else first.schema).dumps()
        except ShardError as exc:  # a bad row fails every attempt alike: reported, not retried
            part = PartitionPart(partition, None, error=str(exc)).dumps()
        yield pa.RecordBatch.from_pydict({"part": [part]})

    sc = spark.sparkContext
    group = f"stallfree-write-{uuid.uuid4().hex[:12]}"
    previous = sc.getLocalProperty("spark.jobGroup.id")
    try:
        sc.setLocalProperty("spark.jobGroup.id", group)  # this thread's jobs, to wait for on failure
        try:
            rows = df.mapInArrow(write, "part string").collect()
        except BaseException:
            _wait_for_tasks_to_stop(sc, group)
            raise
        finally:
            sc.setLocalProperty("spark.jobGroup.id", previous)
        parts = [PartitionPart.loads(row.part) for row in rows]
        bad = first_error(parts)
        if bad is not None:
            raise ShardTaskError(f"partition {bad.partition} of the DataFrame: {bad.error}")
    except BaseException as exc:
        remove_run_files(dest)
        if isinstance(exc, ShardError) or not _is_java_error(exc):
            raise
        raise _task_error(exc, ()) from None
    return commit_parts(dest, spec, parts, started, {"writer": "write_spark"})


def _is_java_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith(("py4j", "pyspark"))
