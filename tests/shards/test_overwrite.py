"""``stallfree shard --overwrite`` is all or nothing: a failure at any step (a shard's source or
write, a shard's rename, a shard lost before the commit, the manifest's write) leaves the old
dataset byte-identical and verifiable; success replaces it whole. A killed run's temp files are
removed by the next run, never a live writer's.

Every failing run happens in a subprocess (the CLI, or a child running one scenario) with a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300


CLI_CODE = "import sys\nfrom stallfree.cli import main\nsys.exit(main(sys.argv[1:]))"


def cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``stallfree ARGS`` in a fresh interpreter; ``prelude`` runs first (e.g. a file-size limit)."""
    return _python(f"{prelude}\n{CLI_CODE}", *args)


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c code args`` in a fresh interpreter (these children import no torch: a fresh one
    costs less than a child of the torch-preloaded tests/zygote.py, whose exit alone is dearer)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT
    )


def write_rows(path: Path, n: int, *, bad_line: int | None = None, tag: str = "v1", big: int = 0) -> Path:
    """JSONL rows ``{"i": i, "t": tag}``; line ``bad_line`` (1-based) is not JSON; ``big`` pads each
    row's text to that many characters."""
    lines = []
    for i in range(n):
        if i + 1 == bad_line:
            lines.append("{not json")
        else:
            lines.append(json.dumps({"i": i, "t": tag + "x" * big}))
    path.write_text("\n".join(lines) + "\n")
    return path


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def samples_of(root: Path) -> list[tuple[str, bytes]]:
    """(key, t field) of every sample, read through open_dataset (so via the manifest)."""
    from stallfree.shards.open import open_dataset

    ds = open_dataset(str(root))
    return [(s["__key__"], bytes(s["t"])) for s in ds]


def verify_ok(root: Path) -> None:
    res = cli("verify", str(root))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def old_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``old`` dataset, written by the CLI once per module; tests get copies of it."""
    tmp = tmp_path_factory.mktemp("old")
    ds = tmp / "ds"
    res = cli(
        "shard", str(write_rows(tmp / "old.jsonl", 200)), str(ds), "--max-samples", "50", "--no-progress"
    )
    assert res.returncode == 0, res.stderr
    return ds


@pytest.fixture
def old(old_template: Path, tmp_path: Path) -> Path:
    """A 200-sample dataset in 4 shards of 50 (shard-000000.tar ... shard-000003.tar), this test's
    own copy (the same bytes the CLI wrote)."""
    ds = tmp_path / "ds"
    shutil.copytree(old_template, ds)
    return ds


# -- the defect as reported, and the other local failure points ------------------------------------
@pytest.mark.parametrize("workers", ["1", "2"])
def test_failed_overwrite_from_a_bad_source_line_keeps_the_old_dataset(
    old: Path, tmp_path: Path, workers: str
):
    before = snapshot(old)
    bad = write_rows(tmp_path / "bad.jsonl", 200, bad_line=171, tag="v2")
    res = cli(
        "shard",
        str(bad),
        str(old),
        "--max-samples",
        "50",
        "--overwrite",
        "--no-progress",
        "--workers",
        workers,
    )
    assert res.returncode == 1
    assert "bad.jsonl: line 171 is not valid JSON" in res.stderr
    assert snapshot(old) == before
    verify_ok(old)
    assert samples_of(old)[170] == ("000000170", b"v1")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_failed_shard_write_keeps_the_old_dataset(old: Path, tmp_path: Path, workers: str):
    """A real write error (the file-size limit, EFBIG) in the third new shard."""
    before = snapshot(old)
    rows = tmp_path / "new.jsonl"
    lines = [json.dumps({"i": i, "t": "v2" + ("x" * 300_000 if i == 120 else "")}) for i in range(200)]
    rows.write_text("\n".join(lines) + "\n")
    limit = "import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    limit += "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))"
    res = cli(
        "shard",
        str(rows),
        str(old),
        "--max-samples",
        "50",
        "--overwrite",
        "--no-progress",
        "--workers",
        workers,
        prelude=limit,
    )
    assert res.returncode == 1
    assert "write failed" in res.stderr and "File too large" in res.stderr, res.stderr
    assert snapshot(old) == before
    verify_ok(old)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_failed_manifest_write_keeps_the_old_dataset(tmp_path: Path, workers: str):
    """Every shard written, then the manifest cannot be (it is bigger than the file-size limit,
    the shards are not): the new shards go, the old dataset stays."""
    ds = tmp_path / "ds"
    res = cli(
        "shard", str(write_rows(tmp_path / "old.jsonl", 60)), str(ds), "--max-samples", "1", "--no-progress"
    )
    assert res.returncode == 0, res.stderr
    before = snapshot(ds)
    assert (
        len(before["manifest.json"]) > 6000 and max(len(v) for v in before.values() if v[:1] != b"{") < 4000
    )
    limit = "import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    limit += "resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))"
    new = write_rows(tmp_path / "new.jsonl", 60, tag="v2")
    res = cli(
        "shard",
        str(new),
        str(ds),
        "--max-samples",
        "1",
        "--overwrite",
        "--no-progress",
        "--workers",
        workers,
        prelude=limit,
    )
    assert res.returncode == 1
    assert "manifest.json" in res.stderr and "File too large" in res.stderr, res.stderr
    assert snapshot(ds) == before
    verify_ok(ds)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_failed_shard_rename_keeps_the_old_dataset(old: Path, tmp_path: Path, workers: str):
    """The third new shard cannot be renamed into place (a non-empty directory holds its name)."""
    blocker = old / "shard-000002.g1.tar"
    (blocker / "inside").mkdir(parents=True)
    before = snapshot(old)
    new = write_rows(tmp_path / "new.jsonl", 200, tag="v2")
    res = cli(
        "shard",
        str(new),
        str(old),
        "--max-samples",
        "50",
        "--overwrite",
        "--no-progress",
        "--workers",
        workers,
    )
    assert res.returncode == 1
    assert "cannot finish" in res.stderr and "shard-000002.g1.tar" in res.stderr, res.stderr
    assert snapshot(old) == before
    assert sorted(p.name for p in old.iterdir() if p.is_file()) == sorted(before)  # no new file left
    verify_ok(old)


# -- success ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", ["1", "2"])
def test_overwrite_replaces_the_dataset_whole(old: Path, tmp_path: Path, workers: str):
    new = write_rows(tmp_path / "new.jsonl", 130, tag="v2")
    res = cli(
        "shard",
        str(new),
        str(old),
        "--max-samples",
        "50",
        "--overwrite",
        "--no-progress",
        "--workers",
        workers,
    )
    assert res.returncode == 0, res.stderr
    g1 = ["shard-000000.g1", "shard-000001.g1", "shard-000002.g1"]
    assert sorted(p.name for p in old.iterdir()) == sorted(
        ["manifest.json"] + [s + ext for s in g1 for ext in (".tar", ".idx", ".sums")]
    )
    manifest = json.loads((old / "manifest.json").read_text())
    assert [s["path"] for s in manifest["shards"]] == [s + ".tar" for s in g1]
    assert samples_of(old) == [(f"{i:09d}", b"v2") for i in range(130)]
    verify_ok(old)
    res = cli("inspect", str(old), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["samples"] == 130, res.stdout + res.stderr

    # and back: the next rewrite takes the plain names, which the g1 dataset does not use
    res = cli(
        "shard",
        str(write_rows(tmp_path / "v3.jsonl", 60, tag="v3")),
        str(old),
        "--max-samples",
        "50",
        "--overwrite",
        "--no-progress",
        "--workers",
        workers,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in old.iterdir()) == [
        "manifest.json",
        "shard-000000.idx",
        "shard-000000.sums",
        "shard-000000.tar",
        "shard-000001.idx",
        "shard-000001.sums",
        "shard-000001.tar",
    ]
    assert samples_of(old) == [(f"{i:09d}", b"v3") for i in range(60)]
    verify_ok(old)
    res = cli("index", str(old), "--overwrite", "--no-progress", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["samples"] == 60, res.stdout + res.stderr
    verify_ok(old)


def test_shard_names_take_the_first_generation_the_old_dataset_does_not_use() -> None:
    from stallfree.shards.parallel import shard_names

    root = "/d"
    assert shard_names("s-{index}", 2, "tar", root, set()) == ["s-0.tar", "s-1.tar"]
    assert shard_names("s-{index}", 2, "tar", root, {"/d/s-1.idx"}) == ["s-0.g1.tar", "s-1.g1.tar"]
    assert shard_names("s-{index}", 2, "tar", root, {"/d/s-0.tar", "/d/s-1.g1.tar"}) == [
        "s-0.g2.tar",
        "s-1.g2.tar",
    ]
    assert shard_names("s-{index}", 2, "arrow", root, {"/d/s-0.tar", "/d/s-0.idx"}) == [
        "s-0.arrow",
        "s-1.arrow",
    ]


# -- a remote (fsspec) destination: memory://, with faults at each step ------------------------------
CHILD = r'''
import json, sys, logging
import fsspec
from fsspec.implementations.memory import MemoryFileSystem
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.errors import ShardError

class Faulty(MemoryFileSystem):
    """memory:// (the same store) whose ``fault`` step fails once, as a remote store might."""
    protocol = ("faultmem",)
    fault = None

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("faultmem://"))

    def _fail(self, step, path):
        if Faulty.fault == step:
            Faulty.fault = None
            raise OSError(f"injected {step} failure at {path}")

    def _open(self, path, mode="rb", **kw):
        if "w" in mode and "shard-000002.g1.tar" in path:
            self._fail("open-shard", path)
        return super()._open(path, mode, **kw)

    def mv(self, path1, path2, **kw):
        if path2.endswith("shard-000002.g1.tar") and Faulty.fault == "lose-shard":
            Faulty.fault = None
            self.rm_file(path1)  # "renamed", but the object never shows up
            return None
        if path2.endswith("manifest.json"):
            self._fail("manifest-before", path2)
            out = super().mv(path1, path2, **kw)
            self._fail("manifest-after", path2)
            return out
        return super().mv(path1, path2, **kw)

    def rm_file(self, path):
        if path.endswith("shard-000001.tar"):
            self._fail("rm-old", path)
        return super().rm_file(path)

fsspec.register_implementation("faultmem", Faulty, clobber=True)
src_old, src_new, fault = sys.argv[1:4]
mem = fsspec.filesystem("memory")
shard_dataset(open_source(src_old), "memory://ow/ds", max_samples=50)
before = {p: mem.cat_file(p) for p in sorted(mem.find("/ow"))}
Faulty.fault = fault
try:
    shard_dataset(open_source(src_new), "faultmem://ow/ds", max_samples=50, overwrite=True)
    error = None
except ShardError as exc:
    error = f"{type(exc).__name__}: {exc}"
after = {p: mem.cat_file(p) for p in sorted(mem.find("/ow"))}
from stallfree.shards.open import open_dataset
ds = open_dataset("memory://ow/ds")
print(json.dumps({
    "error": error,
    "unchanged": before == after,
    "files": sorted(p.rsplit("/", 1)[1] for p in after),
    "problems": [repr(p) for p in ds.verify()],
    "t": sorted({bytes(s["t"]).decode() for s in ds}),
    "samples": len(ds),
}))
'''


def remote(tmp_path: Path, fault: str) -> dict:
    old_src = write_rows(tmp_path / "old.jsonl", 200)
    new_src = write_rows(tmp_path / "new.jsonl", 150, tag="v2")
    res = _python(CHILD, str(old_src), str(new_src), fault)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


SIDECARS = (".idx", ".sums", ".tar")
OLD_FILES = ["manifest.json"] + [f"shard-00000{i}{ext}" for i in range(4) for ext in SIDECARS]
NEW_FILES = ["manifest.json"] + [f"shard-00000{i}.g1{ext}" for i in range(3) for ext in SIDECARS]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("open-shard", "cannot write .*shard-000002.g1.tar: OSError: injected open-shard failure"),
        ("lose-shard", "shard-000002.g1.tar is missing after it was written"),
        ("manifest-before", "cannot finish .*manifest.json: OSError: injected manifest-before failure"),
    ],
)
def test_remote_failure_keeps_the_old_dataset(tmp_path: Path, fault: str, message: str) -> None:
    import re

    out = remote(tmp_path, fault)
    assert out["error"] is not None and re.search(message, out["error"]), out["error"]
    assert out["unchanged"] and out["files"] == OLD_FILES
    assert out["problems"] == [] and out["t"] == ["v1"] and out["samples"] == 200


def test_remote_overwrite_and_failures_after_the_commit(tmp_path: Path) -> None:
    for fault in ("none", "manifest-after", "rm-old"):
        out = remote(tmp_path, fault)
        assert out["error"] is None, (fault, out)
        assert out["problems"] == [] and out["t"] == ["v2"] and out["samples"] == 150
        if fault == "rm-old":  # left behind with a warning; the new dataset stands
            assert out["files"] == sorted(NEW_FILES + ["shard-000001.tar"])
        else:
            assert out["files"] == NEW_FILES


# -- temp files of a killed run ----------------------------------------------------------------------
def _temps(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if ".tmp-" in p.name) if root.exists() else []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_killed_runs_temp_files_are_removed_by_the_next_run(tmp_path: Path, workers: str) -> None:
    """A real ``stallfree shard`` blocks reading a FIFO (the second sample) with the shard's temp file
    open, and is SIGKILLed; the next run removes that temp file (its writer is gone)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 1000)
    os.mkfifo(src / "b.bin")
    ds = tmp_path / "ds"
    args = [
        sys.executable,
        "-m",
        "stallfree",
        "shard",
        str(src),
        str(ds),
        "--source",
        "files",
        "--max-samples",
        "1",
        "--workers",
        workers,
        "--no-shuffle",  # the FIFO b.bin must be the second shard
        "--no-progress",
    ]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT
        # blocked on the FIFO in shard 1, and shard 0 (another worker's, with --workers 2) is in
        # place: else the kill can land while shard 0's temp files are still being renamed
        while not (
            any(p.name.startswith(".shard-000001.tar.tmp-") for p in _temps(ds))
            and not any(p.name.startswith(".shard-000000.") for p in _temps(ds))
        ):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run never opened its second shard"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
    left = _temps(ds)
    assert [p.name.split(".tmp-")[0] for p in left] == [".shard-000001.tar"]
    writer_pid = int(left[0].name.rsplit("-", 2)[1])
    deadline = time.monotonic() + TIMEOUT
    while _alive(writer_pid):  # a worker dies with its parent (PR_SET_PDEATHSIG)
        assert time.monotonic() < deadline, f"worker {writer_pid} outlived its killed parent"
        time.sleep(0.05)

    # a live writer's temp file (this test's own pid) and a fresh one of another host are kept
    host = left[0].name.split(".tmp-")[1].rsplit("-", 2)[0]
    live = ds / f".shard-000009.tar.tmp-{host}-{os.getpid()}-0123456789ab"
    foreign = ds / ".shard-000008.tar.tmp-otherhost-1-0123456789ab"
    ancient = ds / ".shard-000007.tar.tmp-otherhost-1-ba9876543210"
    for p in (live, foreign, ancient):
        p.write_bytes(b"partial")
    os.utime(ancient, (time.time() - 3 * 86400,) * 2)

    (src / "b.bin").unlink()
    (src / "b.bin").write_bytes(b"b" * 1000)
    res = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    assert [p.name for p in _temps(ds)] == sorted([foreign.name, live.name])
    assert sorted(p.name for p in ds.iterdir() if ".tmp-" not in p.name) == [
        "manifest.json",
        "shard-000000.idx",
        "shard-000000.sums",
        "shard-000000.tar",
        "shard-000001.idx",
        "shard-000001.sums",
        "shard-000001.tar",
    ]
    verify_ok(ds)


def _alive(pid: int) -> bool:
    from stallfree.storage.atomic import _pid_alive

    return _pid_alive(pid)


# -- the Python writer, over an existing dataset -------------------------------------------------------
WRITER_CHILD = r"""
import sys
from stallfree.shards.writer import ShardWriter
root, tag, fail_at = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
with ShardWriter(root, format=sys.argv[4], max_samples=5) as w:
    for i in range(12):
        if i == fail_at:
            raise RuntimeError(f"the loop feeding the writer failed at sample {i}")
        w.write({"__key__": f"k{i:03d}", "t": tag})
"""


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_shard_writer_over_a_dataset_is_all_or_nothing(tmp_path: Path, fmt: str) -> None:
    def write(tag: str, fail_at: int) -> subprocess.CompletedProcess:
        return _python(WRITER_CHILD, str(tmp_path / "ds"), tag, str(fail_at), fmt)

    assert write("v1", -1).returncode == 0
    before = snapshot(tmp_path / "ds")
    res = write("v2", 11)  # two new shards finished, the third in progress
    assert res.returncode == 1 and "failed at sample 11" in res.stderr
    from stallfree.shards.open import open_dataset

    ds = open_dataset(str(tmp_path / "ds"))
    assert ds.verify() == [] and {bytes(s["t"]) for s in ds} == {b"v1"}
    assert {k: v for k, v in snapshot(tmp_path / "ds").items() if ".g1." not in k} == before

    assert write("v2", -1).returncode == 0
    ds = open_dataset(str(tmp_path / "ds"))
    assert ds.verify() == [] and [(s["__key__"], bytes(s["t"])) for s in ds] == [
        (f"k{i:03d}", b"v2") for i in range(12)
    ]
    ext = [".tar", ".idx", ".sums"] if fmt == "tar" else [".arrow"]
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == sorted(
        ["manifest.json"] + [f"shard-00000{i}.g1{e}" for i in range(3) for e in ext]
    )
