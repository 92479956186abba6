"""Re-sharding existing tars loses no sample in silence: a cut archive, or a member name that
would escape a folder (absolute, ``..``), follows ``--on-error`` (raise: one error line naming the
file and byte offset; skip: listed as skipped in the summary and the manifest)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from stallfree.errors import WriteError
from stallfree.shards.naming import check_key
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import SourceReadError, open_source
from stallfree.shards.tar.idx import parse_idx
from stallfree.shards.writer import ShardWriter

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stallfree", *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )


@pytest.fixture
def cut(tmp_path: Path) -> tuple[Path, int]:
    """Two 100-sample shards; shard 1 cut 100 bytes into the header of its 61st sample (k0160)."""
    root = tmp_path / "ds"
    with ShardWriter(str(root), max_samples=100) as w:
        for i in range(200):
            w.write({"__key__": f"k{i:04d}", "txt": "x" * 300, "cls": i})
    sample = parse_idx((root / "shard-000001.idx").read_text(), "s")[60]
    header = sample.members[0][1] - 512
    os.truncate(root / "shard-000001.tar", header + 100)
    return root, header


def test_reshard_of_a_cut_tar_is_an_error_naming_file_and_offset(cut, tmp_path: Path) -> None:
    root, header = cut
    res = cli("shard", str(root / "*.tar"), str(tmp_path / "out"), "--source", "tar", "--no-progress")
    assert res.returncode == 1, res.stdout
    assert res.stderr.strip().splitlines()[-1] == (
        f"stallfree shard: error: cannot read source file {root / 'shard-000001.tar'}: truncated tar: header cut "
        f"short; this sample and every one after it are left out (sample 'k0159', byte offset {header})"
    )
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_reshard_of_a_cut_tar_with_skip_lists_what_was_lost(cut, tmp_path: Path) -> None:
    root, header = cut
    out = tmp_path / "out"
    res = cli(
        "shard", str(root / "*.tar"), str(out), "--source", "tar", "--no-progress", "--on-error", "skip"
    )
    assert res.returncode == 0, res.stderr
    # k0159 is whole as far as the file goes, but whether more of its members followed is unknown
    assert [s["__key__"] for s in open_dataset(str(out))] == [f"k{i:04d}" for i in range(159)]
    skipped = [{"source": str(root / "shard-000001.tar"), "error": _lost(header)}]
    assert json.loads((out / "manifest.json").read_text())["skipped"] == skipped
    assert "skipped: none" not in res.stdout
    assert f"{root / 'shard-000001.tar'}: {_lost(header)}" in res.stdout


def _lost(header: int) -> str:
    return (
        "truncated tar: header cut short; this sample and every one after it are left out "
        f"(sample 'k0159', byte offset {header})"
    )


def _unsafe_tar(path: Path) -> Path:
    """A real tar (Python's tarfile) holding members that must never be copied by name."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in (
            ("ok.txt", b"fine"),
            ("../evil.txt", b"up"),
            ("/etc/abs.txt", b"root"),
            ("a/../../deep.txt", b"deep"),
            ("also/ok.txt", b"fine too"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_unsafe_member_names_raise_naming_file_member_and_offset(tmp_path: Path) -> None:
    path = _unsafe_tar(tmp_path / "u.tar")
    names = [m.name for m in tarfile.open(path)]
    assert names[1:4] == ["../evil.txt", "/etc/abs.txt", "a/../../deep.txt"]  # tarfile kept them
    with pytest.raises(SourceReadError) as err:
        open_source(str(path), "tar").items()
    assert err.value.path == str(path)
    assert (err.value.key, err.value.offset) == ("../evil", 1024)
    assert err.value.reason == "member name '../evil.txt' is absolute or has a '..' part; refusing to copy it"


def test_unsafe_member_names_are_skipped_and_never_written(tmp_path: Path) -> None:
    path = _unsafe_tar(tmp_path / "u.tar")
    src = open_source(str(path), "tar", on_error="skip")
    out = tmp_path / "out"
    summary = shard_dataset(src, str(out), on_error="skip")  # an absolute name used to abort here
    assert [s["__key__"] for s in open_dataset(str(out))] == ["ok", "also/ok"]
    written = [m.name for t in sorted(out.glob("*.tar")) for m in tarfile.open(t)]
    assert written == ["ok.txt", "also/ok.txt"]
    assert [(s["source"], s["error"].split(";")[0]) for s in summary.skipped] == [
        (str(path), "member name '../evil.txt' is absolute or has a '..' part"),
        (str(path), "member name '/etc/abs.txt' is absolute or has a '..' part"),
        (str(path), "member name 'a/../../deep.txt' is absolute or has a '..' part"),
    ]
    assert summary.skipped[0]["error"].endswith("(sample '../evil', byte offset 1024)")
    assert json.loads((out / "manifest.json").read_text())["skipped"] == summary.skipped


def test_writer_refuses_keys_that_escape_a_folder() -> None:
    for key in ("../x", "a/../../x", "/abs/x", ".."):
        with pytest.raises(WriteError, match="invalid sample key"):
            check_key(key)
    assert check_key("a/b/c") == "a/b/c" and check_key("./a") == "./a"
