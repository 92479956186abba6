"""A Spark cluster on loopback for tests and benchmarks: ``local-cluster[N,C,M]`` (a master and
N worker processes with real executor JVMs and Python workers, all on this machine), the driver
and every executor bound to 127.0.0.1, no web UI, no console progress bars.

Usage (one per test module: a start takes seconds)::

    from stallfree.testing.spark_cluster import spark_unavailable, local_spark_cluster

    @pytest.fixture(scope="module")
    def spark():
        if (reason := spark_unavailable()) is not None:
            pytest.skip(reason)
        with local_spark_cluster() as session:
            yield session

``spark_unavailable()`` names what is missing (pyspark, java). The executors run this
interpreter (``spark.pyspark.python``), so they import the stallfree the test imports.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


_SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_unavailable() -> str | None:
    """Why a local Spark cluster cannot start here (None: it can)."""
    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed (pip install 'stallfree[spark]')"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no java on PATH (Spark needs a JRE: scripts/setup.sh installs default-jre-headless)"
    return None


@contextlib.contextmanager
def local_spark_cluster(
    workers: int = 2, cores: int = 1, memory_mb: int = 1024, conf: dict[str, str] | None = None
) -> Iterator[Any]:
    """A ``SparkSession`` on ``local-cluster[workers,cores,memory_mb]``, every process on
    127.0.0.1, with all ``workers`` executors registered before it is yielded; stopped after."""
    from pyspark.sql import SparkSession

    # The JVM reads its bind address from the environment it is launched with (this process's):
    # without it the workers and executors take the machine's outside address.
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    # pyspark starts its Python workers with PYSPARK_PYTHON (else ``python3`` from PATH): this
    # interpreter, so the executors import the stallfree under test
    os.environ["PYSPARK_PYTHON"] = sys.executable
    scratch = tempfile.mkdtemp(prefix="stallfree-spark-")
    builder = (
        SparkSession.builder.master(f"local-cluster[{workers},{cores},{memory_mb}]")
        .appName("stallfree-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.pyspark.driver.python", sys.executable)
        .config("spark.local.dir", scratch)
        .config("spark.executor.memory", f"{max(256, memory_mb // 2)}m")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        # a cluster that lives for a test module: the JVMs' C2 compiler threads were most of its
        # CPU (start-up 22 -> 13 CPU-s with C1 only and the serial collector, on 2 cores)
        .config("spark.driver.extraJavaOptions", _SHORT_LIVED_JVM)
        .config("spark.executor.extraJavaOptions", _SHORT_LIVED_JVM)
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    try:
        hosts = wait_for_executors(session, workers)
        log.info("local Spark cluster: executors on %s", hosts)
        yield session
    finally:
        session.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def wait_for_executors(spark: Any, count: int, timeout_s: float = 120.0) -> list[str]:
    """Block until ``count`` executors have registered (a just-started cluster registers them
    asynchronously); their hosts. TimeoutError naming how many came."""
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    deadline = time.monotonic() + timeout_s
    while True:
        infos = tracker.getExecutorInfos()
        if len(infos) - 1 >= count:  # the driver is listed too
            return sorted({i.host() for i in infos})
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(infos) - 1} of {count} Spark executors registered in {timeout_s:.0f}s")
        time.sleep(0.2)


def partition_batches(df: Any) -> dict[int, list[Any]]:
    """``df``'s partitions as the Arrow record batches a ``mapInArrow`` task receives (what
    ``write_spark``'s tasks get), brought to the driver: partition id -> its batches in order.
    A reference run writes them row by row to compare bytes with the engine's output."""
    import pyarrow as pa

    def ship(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        partition = TaskContext.get().partitionId()
        for batch in batches:
            yield pa.RecordBatch.from_pydict(
                {
                    "p": [partition],
                    "schema": [batch.schema.serialize().to_pybytes()],
                    "batch": [batch.serialize().to_pybytes()],
                }
            )

    parts: dict[int, list[Any]] = {}
    for row in df.mapInArrow(ship, "p long, schema binary, batch binary").collect():
        schema = pa.ipc.read_schema(pa.py_buffer(row.schema))
        parts.setdefault(row.p, []).append(pa.ipc.read_record_batch(pa.py_buffer(row.batch), schema))
    return parts
