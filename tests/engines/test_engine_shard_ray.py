"""``stallfree shard`` on a real Ray cluster (``stallfree/testing/ray_cluster.py``: a head and two
worker nodes, each its own raylet, all on 127.0.0.1, dashboard and usage stats off) and
``write_ray``: output byte-identical to a local run, a task that fails its first attempt retried
with the same bytes, an existing dataset untouched by a failed overwrite, the S3 server as
destination. One cluster for the module; pytest's timeout bounds a hang."""

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

pytestmark = pytest.mark.slow
RETRIES = 1  # one retry after the first attempt: real, and the failing tests cheap


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray", reason="ray is not installed (pip install 'stallfree[ray]')")
    from ray import cloudpickle

    from stallfree.testing.ray_cluster import loopback_cluster

    # the planted faults below are classes of this module: sent to the workers by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with loopback_cluster(worker_nodes=2, resource=None) as running:
        yield running


@pytest.fixture(scope="module")
def executor(cluster):
    from stallfree.engines.ray_shard import RayExecutor

    with RayExecutor(max_retries=RETRIES) as ex:
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
def test_ray_output_is_byte_identical_to_local(executor, folder, table, tmp_path, kind):
    src, fmt = (folder, "tar") if kind == "imagefolder-tar" else (table, "arrow")
    local = shard_dataset(str(src), str(tmp_path / "local"), format=fmt, max_samples=5)
    seen: list[tuple[int, int]] = []
    on_ray = shard_dataset(
        str(src), str(tmp_path / "ray"), format=fmt, max_samples=5, executor=executor,
        progress=lambda samples, nbytes: seen.append((samples, nbytes)),
    )  # fmt: skip
    assert len(local.manifest.shards) >= 3
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")
    assert on_ray.manifest.to_json() == local.manifest.to_json()
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
    on_ray = shard_dataset(
        str(folder), str(tmp_path / "ray"), max_samples=5, executor=executor, transform=planted
    )
    assert marker.read_text() == "failed once"  # the first attempt did fail
    shard_dataset(str(folder), str(tmp_path / "local"), max_samples=5, transform=planted)
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")
    assert on_ray.manifest.transform == {"planted": "fail-first-attempt"}


@pytest.mark.parametrize("error, attempts", [(RuntimeError, 1 + RETRIES), (SampleDecodeError, 1)])
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
    # Ray's retries (max_retries) for a crash; none for a bad sample
    assert len(list(tmp_path.glob("attempt*"))) == attempts
    assert tree(dst) == before


def test_s3_destination(executor, folder, tmp_path):
    from stallfree.testing.s3serve import moto_available, serve_s3

    if (reason := moto_available()) is not None:
        pytest.skip(reason)
    local = shard_dataset(str(folder), str(tmp_path / "local"), max_samples=5)
    with serve_s3() as s3:
        s3.create_bucket("ray-out")
        shard_dataset(str(folder), "s3://ray-out/ds", max_samples=5, executor=executor, **s3.storage_options)
        fs = s3.filesystem()
        remote = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in sorted(fs.ls("ray-out/ds", detail=False))}
    assert remote == tree(tmp_path / "local")
    assert len(local.manifest.shards) == 3


def test_the_nodes_of_the_cluster_are_this_machine(cluster, executor):
    from stallfree.engines.executor import is_this_machine

    assert executor.nodes() == ["127.0.0.1"]
    assert all(is_this_machine(node) for node in executor.nodes())


# -- write_ray --------------------------------------------------------------------------------------
def _dataset(n: int = 23, blocks: int = 3):
    import ray

    rows = [
        {"__key__": f"k{i:03d}", "image": bytes([i]) * (30 + i), "label": i * 10, "caption": f"caption {i}"}
        for i in range(n)
    ]
    return ray.data.from_items(rows, override_num_blocks=blocks)


def test_write_ray_tar_reads_back_exactly(cluster, tmp_path):
    from stallfree.shards import write_ray

    summary = write_ray(_dataset(), str(tmp_path / "tar"), format="tar", max_samples=4)
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


def test_write_ray_arrow_keeps_column_types(cluster, tmp_path):
    from stallfree.shards import write_ray

    write_ray(_dataset(), str(tmp_path / "arrow"), format="arrow", max_bytes=2_000)
    manifest = json.loads((tmp_path / "arrow" / "manifest.json").read_text())
    assert manifest["field_types"] == {"image": "binary", "label": "int64", "caption": "string"}
    ds = open_dataset(str(tmp_path / "arrow"))
    got = {s["__key__"]: s for s in (ds[i] for i in range(len(ds)))}
    assert got["k007"]["image"] == bytes([7]) * 37 and got["k007"]["label"] == 70


def test_write_ray_failed_overwrite_keeps_the_old_dataset(cluster, tmp_path):
    import ray

    from stallfree.engines.executor import ShardTaskError
    from stallfree.shards import write_ray

    dst = tmp_path / "ds"
    write_ray(_dataset(), str(dst), max_samples=4)
    before = tree(dst)
    bad = ray.data.from_items([{"__key__": "ok1", "image": b"a"}, {"__key__": "../escape", "image": b"b"}])
    with pytest.raises(ShardTaskError, match=r"write task \d+ of the Dataset: .*\.\./escape"):
        write_ray(bad, str(dst), overwrite=True)
    assert tree(dst) == before
    summary = write_ray(bad, str(dst), overwrite=True, on_error="skip")
    assert summary.samples == 1 and summary.skipped[0]["key"] == "../escape"
    assert [s["__key__"] for s in open_dataset(str(dst))] == ["ok1"]


def test_skipped_samples_of_every_task_are_gathered_into_the_manifest(executor, folder, tmp_path):
    key = _key_in_third_shard(folder, tmp_path)
    planted = AlwaysFail(key, str(tmp_path / "attempt"), SampleDecodeError)
    on_ray = shard_dataset(
        str(folder),
        str(tmp_path / "ray"),
        max_samples=5,
        executor=executor,
        transform=planted,
        on_error="skip",
    )
    local = shard_dataset(
        str(folder), str(tmp_path / "local"), max_samples=5, transform=planted, on_error="skip"
    )
    assert [s["source"] for s in on_ray.skipped] == [s["source"] for s in local.skipped] and len(
        local.skipped
    ) == 1
    assert f"planted failure at {key}" in on_ray.skipped[0]["error"]
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")


def test_webdataset_reads_what_write_ray_wrote(cluster, tmp_path):
    wds = pytest.importorskip("webdataset")
    from stallfree.shards import write_ray

    summary = write_ray(_dataset(n=9, blocks=2), str(tmp_path / "tar"), max_samples=4)
    urls = [str(tmp_path / "tar" / s.path) for s in summary.manifest.shards]
    got = {s["__key__"]: s["image"] for s in wds.WebDataset(urls, shardshuffle=False)}
    assert got == {f"k{i:03d}": bytes([i]) * (30 + i) for i in range(9)}


def test_cli_engine_ray_address_writes_what_local_writes(cluster, folder, tmp_path):
    import os
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "stallfree",
        "shard",
        str(folder),
        str(tmp_path / "cli"),
        "--max-samples",
        "5",
    ]
    cmd += ["--engine", f"ray:{cluster.address}", "--no-progress", "--json"]
    done = subprocess.run(cmd, env={**os.environ, **cluster.env}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["samples"] == 12
    shard_dataset(str(folder), str(tmp_path / "local"), max_samples=5)
    assert tree(tmp_path / "cli") == tree(tmp_path / "local")
