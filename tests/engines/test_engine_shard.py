"""The executor seam of ``stallfree shard`` without a cluster: engine names, the rule that keeps
a cluster off machine-local paths, the local executor's output, and what a failed remote run
removes. The engines themselves: ``test_engine_shard_spark.py``, ``test_engine_shard_ray.py``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from stallfree.cli import main
from stallfree.engines.executor import (
    EngineSpec,
    LocalExecutor,
    UnreachablePathError,
    check_reachable,
    is_this_machine,
    make_executor,
    parse_engine,
)
from stallfree.shards.parallel import ShardJob, ShardResult, ShardTask, run_task, shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.testing.images import make_image_folder

FOREIGN = "203.0.113.7"  # TEST-NET-3: never this machine


def tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(
        tmp_path_factory.mktemp("src") / "imf", classes=2, per_class=4, sizes=((40, 32),)
    )


def test_engine_names_and_addresses():
    assert parse_engine("local") == EngineSpec("local")
    assert parse_engine("ray") == EngineSpec("ray")
    assert parse_engine("ray:10.0.0.1:6379") == EngineSpec("ray", "10.0.0.1:6379")
    assert parse_engine("spark:spark://head:7077") == EngineSpec("spark", "spark://head:7077")
    assert parse_engine("SPARK:local[4]") == EngineSpec("spark", "local[4]")
    assert str(EngineSpec("spark", "local[2]")) == "spark:local[2]"
    with pytest.raises(ValueError, match=r"unknown engine 'dask': choose local, ray, spark"):
        parse_engine("dask")
    with pytest.raises(ValueError, match="give an address after ':'"):
        parse_engine("ray:")
    with pytest.raises(ValueError, match="takes no address"):
        parse_engine("local:4")


def test_this_machine_is_recognised_by_loopback_name_and_address():
    assert is_this_machine("127.0.0.1") and is_this_machine("127.0.0.1:7077")
    assert is_this_machine("[::1]:6379") and is_this_machine("localhost")
    import socket

    assert is_this_machine(socket.gethostname())
    assert not is_this_machine(FOREIGN) and not is_this_machine(f"{FOREIGN}:7077")


def _job(source, dst: str, **storage_options) -> ShardJob:
    return ShardJob(source, "tar", "raise", None, None, dst, storage_options)


def test_a_cluster_with_another_machine_is_refused_local_paths(folder: Path, tmp_path: Path):
    source = open_source(folder)
    dst = str(tmp_path / "out")
    with pytest.raises(UnreachablePathError) as caught:
        check_reachable("spark (spark://head:7077)", ["127.0.0.1", FOREIGN], _job(source, dst))
    message = str(caught.value)
    assert f"the destination {dst} is a path on this machine" in message
    assert FOREIGN in message and "--shared-fs" in message
    # the source is checked too (here with a destination the cluster can reach)
    with pytest.raises(UnreachablePathError, match=f"the source {folder} is a path on this machine"):
        check_reachable("ray", [FOREIGN], _job(source, "s3://bucket/out", anon=True))
    # every node this machine (a one-machine cluster, the tests), or a filesystem said to be shared
    check_reachable("spark", ["127.0.0.1", "localhost:4040"], _job(source, dst))
    check_reachable("spark", [FOREIGN], _job(source, dst), shared_fs=True)
    assert not (tmp_path / "out").exists()  # nothing written by a check


def test_memory_urls_are_refused_to_any_cluster_engine(folder: Path):
    with pytest.raises(UnreachablePathError, match="memory://held is in this process's memory"):
        check_reachable("spark", ["127.0.0.1"], _job(open_source(folder), "memory://held"))


def test_the_local_executor_is_today_s_workers(folder: Path, tmp_path: Path):
    shard_dataset(str(folder), str(tmp_path / "default"), max_samples=3)
    executor = make_executor("local", workers=2)
    assert isinstance(executor, LocalExecutor) and executor.nodes() == []
    with executor:
        shard_dataset(str(folder), str(tmp_path / "local"), max_samples=3, executor=executor)
    assert tree(tmp_path / "local") == tree(tmp_path / "default")
    assert len([n for n in tree(tmp_path / "local") if n.endswith(".tar")]) == 3


@dataclass
class _LostReports:
    """A remote runner whose tasks all rename their shards into place but whose results are lost
    (a task killed after its rename), then the job fails: what a cluster can do."""

    remote: bool = True

    def prepare(self, job: ShardJob) -> None:
        pass

    def run(
        self,
        job: ShardJob,
        tasks: Sequence[ShardTask],
        on_result: Callable[[ShardResult], None],
        progress: object,
    ) -> None:
        for task in tasks:
            run_task(job, task)
        raise RuntimeError("executor lost after the renames")


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_remote_run_removes_every_planned_shard(folder: Path, tmp_path: Path, existing: bool):
    dst = tmp_path / "out"
    if existing:
        shard_dataset(str(folder), str(dst), max_samples=2)
    before = tree(dst) if existing else {}
    with pytest.raises(RuntimeError, match="executor lost after the renames"):
        shard_dataset(str(folder), str(dst), max_samples=3, overwrite=existing, executor=_LostReports())
    assert (tree(dst) if dst.exists() else {}) == before


def test_cli_engine_errors_are_usage_errors(folder: Path, tmp_path: Path, capsys):
    out = str(tmp_path / "o")
    assert main(["shard", str(folder), out, "--engine", "dask", "--no-progress"]) == 2
    assert "unknown engine 'dask'" in capsys.readouterr().err
    assert main(["shard", str(folder), out, "--shared-fs", "--no-progress"]) == 2
    assert "--shared-fs applies only with a cluster --engine" in capsys.readouterr().err
    assert main(["shard", str(folder), out, "--engine", "ray", "--workers", "4", "--no-progress"]) == 2
    assert "--workers applies to --engine local" in capsys.readouterr().err
    assert not Path(out).exists()


def test_naming_the_local_engine_imports_no_cluster_library(tmp_path: Path):
    code = (
        "import sys; from stallfree.engines.executor import make_executor; make_executor('local');"
        "import stallfree.shards.parallel;"
        "print(sorted(m for m in ('pyspark', 'ray', 'py4j') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("engine, extra", [("spark:local[1]", "spark"), ("ray", "ray")])
def test_a_missing_engine_library_names_its_extra(monkeypatch, engine, extra):
    from stallfree.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "pyspark" if extra == "spark" else "ray", None)  # not importable
    with pytest.raises(MissingExtra, match=rf"pip install 'stallfree\[{extra}\]'"):
        make_executor(engine)


@dataclass
class _KilledMidWrite(_LostReports):
    """A remote runner whose last task is killed mid-write (Ray's ``cancel(force=True)``): its
    shard's temp file stays behind, named for the planned shard, then the job fails."""

    def run(self, job, tasks, on_result, progress) -> None:
        from stallfree.storage.atomic import temp_name

        for task in tasks[:-1]:
            run_task(job, task)
        Path(temp_name(tasks[-1].path)).write_bytes(b"half a shard")
        raise RuntimeError("a task was killed mid-write")


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_remote_run_removes_a_killed_tasks_temp_file(folder: Path, tmp_path: Path, existing: bool):
    dst = tmp_path / "out"
    if existing:
        shard_dataset(str(folder), str(dst), max_samples=2)
    before = tree(dst) if existing else {}
    with pytest.raises(RuntimeError, match="killed mid-write"):
        shard_dataset(str(folder), str(dst), max_samples=3, overwrite=existing, executor=_KilledMidWrite())
    assert (tree(dst) if dst.exists() else {}) == before
