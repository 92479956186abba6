"""``stallfree shard`` on a real Spark cluster (``local-cluster[2,1,1024]``: a master, two worker
JVMs with their own executors and Python workers, all on 127.0.0.1) and ``write_spark``: output
byte-identical to a local run, a task that fails its first attempt retried with the same bytes,
an existing dataset untouched by a failed ``--overwrite``, the S3 server as destination. One
cluster for the module (a start takes tens of seconds); pytest's timeout bounds a hang."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.errors import SampleDecodeError
from stallfree.shards import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import SourceReadError
from stallfree.testing.images import make_image_folder
from stallfree.testing.spark_cluster import local_spark_cluster, partition_batches, spark_unavailable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark():
    reason = spark_unavailable()
    if reason is not None:
        pytest.skip(reason)
    from pyspark import cloudpickle

    # the planted faults below are classes of this module: sent to the executors by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # two attempts per task (Spark's default is four): the retry is still real, the failing tests cheaper
    with local_spark_cluster(
        workers=2, cores=1, memory_mb=1024, conf={"spark.task.maxFailures": "2"}
    ) as session:
        yield session


@pytest.fixture(scope="module")
def executor(spark):
    from stallfree.engines.spark import SparkExecutor

    with SparkExecutor(spark=spark) as ex:
        yield ex


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(
        tmp_path_factory.mktemp("src") / "imf", classes=3, per_class=4, sizes=((40, 32),)
    )


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tbl") / "rows.parquet"
    n = 30
    pq.write_table(
        pa.table(
            {
                "id": pa.array(range(n), pa.int64()),
                "text": [f"row {i} " + "x" * (i % 7) for i in range(n)],
                "blob": [bytes([i % 256]) * (50 + i) for i in range(n)],
            }
        ),
        path,
        row_group_size=8,
    )
    return path


def tree(root: Path) -> dict[str, bytes]:
    """Every file (hidden ones too: a temp left behind would show) and its bytes."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())} if root.exists() else {}


@pytest.mark.parametrize("kind", ["imagefolder-tar", "parquet-arrow"])
def test_spark_output_is_byte_identical_to_local(executor, folder, table, tmp_path, kind):
    src, fmt = (folder, "tar") if kind == "imagefolder-tar" else (table, "arrow")
    local = shard_dataset(str(src), str(tmp_path / "local"), format=fmt, max_samples=5)
    seen: list[tuple[int, int]] = []
    on_spark = shard_dataset(
        str(src), str(tmp_path / "spark"), format=fmt, max_samples=5, executor=executor,
        progress=lambda samples, nbytes: seen.append((samples, nbytes)),
    )  # fmt: skip
    assert len(local.manifest.shards) >= 3
    assert tree(tmp_path / "spark") == tree(tmp_path / "local")
    assert on_spark.manifest.to_json() == local.manifest.to_json()
    # progress on the driver: every sample and every shard byte, once
    assert sum(s for s, _ in seen) == local.samples
    assert sum(b for _, b in seen) == sum(s.bytes for s in local.manifest.shards)


class FailFirstAttempt:
    """Raises (an ordinary error: Spark retries it) the first time ``key`` is written, leaving a
    marker file so the retry goes through; otherwise writes samples unchanged."""

    def __init__(self, key: str, marker: str) -> None:
        self.key, self.marker = key, marker

    def apply(self, sample: dict[str, Any]) -> tuple[dict[str, Any], int]:
        if sample["__key__"] == self.key and not Path(self.marker).exists():
            Path(self.marker).write_text("failed once")
            raise RuntimeError(f"planted first-attempt failure at {self.key}")
        return sample, 0

    def record(self, changed: int) -> dict[str, Any]:
        return {"planted": "fail-first-attempt"}


class AlwaysFail(FailFirstAttempt):
    """Fails every attempt at ``key``: ``error`` says how (a crash Spark retries, or a bad sample,
    which fails alike on any attempt); each attempt leaves a numbered marker."""

    def __init__(self, key: str, marker: str, error: type[Exception]) -> None:
        super().__init__(key, marker)
        self.error = error

    def apply(self, sample: dict[str, Any]) -> tuple[dict[str, Any], int]:
        if sample["__key__"] == self.key:
            attempts = len(list(Path(self.marker).parent.glob(Path(self.marker).name + "*")))
            Path(f"{self.marker}{attempts}").write_text("attempt")
            raise self.error(f"planted failure at {self.key}")
        return sample, 0


def _key_in_third_shard(folder: Path, tmp_path: Path) -> str:
    probe = shard_dataset(str(folder), str(tmp_path / "probe"), max_samples=5)
    return open_dataset(str(tmp_path / "probe"))[probe.manifest.sample_counts()[0] + 6]["__key__"]


def test_a_task_failing_its_first_attempt_is_retried_with_identical_output(executor, folder, tmp_path):
    key = _key_in_third_shard(folder, tmp_path)
    marker = tmp_path / "marker"
    planted = FailFirstAttempt(key, str(marker))
    on_spark = shard_dataset(
        str(folder), str(tmp_path / "spark"), max_samples=5, executor=executor, transform=planted
    )
    assert marker.read_text() == "failed once"  # the first attempt did fail
    shard_dataset(str(folder), str(tmp_path / "local"), max_samples=5, transform=planted)
    assert tree(tmp_path / "spark") == tree(tmp_path / "local")
    assert on_spark.manifest.transform == {"planted": "fail-first-attempt"}


@pytest.mark.parametrize("error, attempts", [(RuntimeError, 2), (SampleDecodeError, 1)])
def test_a_failed_overwrite_leaves_the_existing_dataset_byte_identical(
    executor, folder, tmp_path, error, attempts
):
    from stallfree.engines.executor import ShardTaskError

    dst = tmp_path / "ds"
    shard_dataset(str(folder), str(dst), max_samples=4)
    before = tree(dst)
    key = _key_in_third_shard(folder, tmp_path)
    planted = AlwaysFail(key, str(tmp_path / "attempt"), error)
    expected = ShardTaskError if error is RuntimeError else SourceReadError
    with pytest.raises(expected) as caught:
        shard_dataset(
            str(folder), str(dst), max_samples=5, overwrite=True, executor=executor, transform=planted
        )
    assert f"planted failure at {key}" in str(caught.value)
    if error is RuntimeError:  # the Python error of the last attempt, not the JVM's stack
        assert f"RuntimeError: planted failure at {key}" in str(caught.value)
    # Spark's retries (spark.task.maxFailures, 2 here) for a crash; none for a bad sample
    assert len(list(tmp_path.glob("attempt*"))) == attempts
    assert tree(dst) == before


def test_s3_destination(executor, folder, tmp_path):
    from stallfree.testing.s3serve import moto_available, serve_s3

    if (reason := moto_available()) is not None:
        pytest.skip(reason)
    local = shard_dataset(str(folder), str(tmp_path / "local"), max_samples=5)
    with serve_s3() as s3:
        s3.create_bucket("spark-out")
        shard_dataset(
            str(folder), "s3://spark-out/ds", max_samples=5, executor=executor, **s3.storage_options
        )
        fs = s3.filesystem()
        remote = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in sorted(fs.ls("spark-out/ds", detail=False))}
    assert remote == tree(tmp_path / "local")
    assert len(local.manifest.shards) == 3


def test_the_nodes_of_a_local_cluster_are_this_machine(executor):
    from stallfree.engines.executor import is_this_machine

    assert executor.master == "local-cluster[2,1,1024]"
    assert all(is_this_machine(node) for node in executor.nodes())


# -- write_spark ------------------------------------------------------------------------------------
def _frame(spark, n: int = 23, partitions: int = 3):
    rows = [(f"k{i:03d}", bytes([i]) * (30 + i), i * 10, f"caption {i}") for i in range(n)]
    schema = "__key__ string, image binary, label long, caption string"
    return spark.createDataFrame(spark.sparkContext.parallelize(rows, partitions), schema)  # no shuffle


def test_write_spark_tar_reads_back_exactly(spark, tmp_path):
    from stallfree.shards import write_spark

    df = _frame(spark)
    summary = write_spark(df, str(tmp_path / "tar"), format="tar", max_samples=4)
    ds = open_dataset(str(tmp_path / "tar"))
    got = {s["__key__"]: s for s in (ds[i] for i in range(len(ds)))}
    assert sorted(got) == [f"k{i:03d}" for i in range(23)]
    for i in range(23):
        s = got[f"k{i:03d}"]
        assert (s["image"], s["label"], s["caption"]) == (
            bytes([i]) * (30 + i),
            str(i * 10).encode(),
            f"caption {i}".encode(),
        )
    names = [s.path for s in summary.manifest.shards]
    assert names == sorted(names) and all(n.startswith("part-") and n.endswith(".tar") for n in names)
    assert all(s.samples <= 4 for s in summary.manifest.shards)
    with tarfile.open(tmp_path / "tar" / names[0]) as tf:  # plain WebDataset tars: key.field members
        assert all(m.name.split(".", 1)[1] in ("caption", "image", "label") for m in tf.getmembers())
    # the same DataFrame again: the same bytes (what a retried partition writes)
    write_spark(df, str(tmp_path / "again"), format="tar", max_samples=4)
    assert tree(tmp_path / "again") == tree(tmp_path / "tar")


def test_write_spark_arrow_keeps_column_types(spark, tmp_path):
    from stallfree.shards import write_spark

    write_spark(_frame(spark), str(tmp_path / "arrow"), format="arrow", max_bytes=2_000)
    manifest = json.loads((tmp_path / "arrow" / "manifest.json").read_text())
    assert manifest["field_types"] == {"image": "binary", "label": "int64", "caption": "string"}
    ds = open_dataset(str(tmp_path / "arrow"))
    got = {s["__key__"]: s for s in (ds[i] for i in range(len(ds)))}
    assert got["k007"]["image"] == bytes([7]) * 37 and got["k007"]["label"] == 70
    assert len(manifest["shards"]) > 3


def test_write_spark_arrow_is_byte_identical_to_writing_row_by_row(spark, tmp_path):
    """The Arrow path (no Python value per row) against every row written as a sample, on the
    same partitions: keys from ``__key__`` with nulls (made from partition and row), nulls in
    every column, several record batches and shards per partition."""
    from stallfree.shards import write_spark
    from stallfree.shards.write_engines import PartitionWrite, commit_parts, open_destination, write_partition

    rows = [
        (
            None if i % 11 == 0 else f"r/{i:04d}",
            None if i % 7 == 0 else bytes([i % 256]) * (i % 90),
            None if i % 5 == 0 else i * 3,
            None if i % 3 == 0 else "é" * (i % 4) + "c" * (i % 60),
        )
        for i in range(2500)
    ]
    schema = "__key__ string, image binary, label long, caption string"
    df = spark.createDataFrame(spark.sparkContext.parallelize(rows, 3), schema)
    ours = write_spark(df, str(tmp_path / "ours"), format="arrow", max_bytes=60_000)
    spec = PartitionWrite(str(tmp_path / "ref"), {}, "arrow", max_bytes=60_000)
    parts = [
        write_partition(spec, p, batches, batches[0].schema, arrow_rows=False)
        for p, batches in sorted(partition_batches(df).items())
    ]
    commit_parts(
        open_destination(spec.dst, overwrite=False, storage_options={}),
        spec,
        parts,
        0.0,
        {"writer": "write_spark"},
    )
    assert tree(tmp_path / "ours") == tree(tmp_path / "ref")
    assert len(ours.manifest.shards) > 3 and ours.samples == 2500


def test_write_spark_failed_overwrite_keeps_the_old_dataset(spark, tmp_path):
    from stallfree.engines.executor import ShardTaskError
    from stallfree.shards import write_spark

    dst = tmp_path / "ds"
    write_spark(_frame(spark), str(dst), max_samples=4)
    before = tree(dst)
    bad = spark.createDataFrame([("ok1", b"a"), ("../escape", b"b")], "__key__ string, image binary")
    with pytest.raises(ShardTaskError, match=r"partition \d+ of the DataFrame: .*\.\./escape"):
        write_spark(bad, str(dst), overwrite=True)
    assert tree(dst) == before
    # the same rows with on_error="skip": the bad row listed, the good one written
    summary = write_spark(bad, str(dst), overwrite=True, on_error="skip")
    assert summary.samples == 1 and summary.skipped[0]["key"] == "../escape"
    assert [s["__key__"] for s in open_dataset(str(dst))] == ["ok1"]
