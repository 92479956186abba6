"""The one tar walker: every tar reader (scan/open_dataset, the loader's reader without an .idx,
verify, the re-shard source) finds a truncated or corrupt archive the same way, at the same spot;
long names (GNU, pax) are read; grouping keeps every whole sample and no partial one."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import fsspec
import pytest

from stallfree.errors import CorruptShardError, DuplicateKeyError
from stallfree.shards.open import open_dataset
from stallfree.shards.scan import scan_tar
from stallfree.shards.sources.registry import SourceReadError, open_source
from stallfree.shards.tar.idx import IdxSample, parse_idx
from stallfree.shards.tar.reader import TarShardReader
from stallfree.shards.tar.walk import RangeReader, TarMember, group_samples, walk_tar
from stallfree.shards.verify import verify_dataset
from stallfree.shards.writer import ShardWriter

LOCAL = fsspec.filesystem("file")


def _tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> Path:
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _walk(path: Path) -> list[TarMember]:
    reader = RangeReader(LOCAL, str(path), path.stat().st_size)
    try:
        return list(walk_tar(reader, path.name))
    finally:
        reader.close()


def _dataset(root: Path, n: int = 200) -> Path:
    with ShardWriter(str(root), max_samples=100) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:04d}", "txt": "x" * 300, "cls": i})
    return root


def _header_of(root: Path, shard: str, row: int) -> tuple[str, int]:
    sample = parse_idx((root / shard.replace(".tar", ".idx")).read_text(), shard)[row]
    return sample.key, sample.members[0][1] - 512


def test_members_with_gnu_and_pax_long_names(tmp_path: Path) -> None:
    long = "d/" + "x" * 150 + "/s0"
    for fmt, name in ((tarfile.GNU_FORMAT, "gnu.tar"), (tarfile.PAX_FORMAT, "pax.tar")):
        path = _tar(tmp_path / name, [(f"{long}.jpg", b"abc"), (f"{long}.cls", b"1"), ("s1.txt", b"hi")], fmt)
        members = _walk(path)
        assert [(m.name, m.size) for m in members] == [(f"{long}.jpg", 3), (f"{long}.cls", 1), ("s1.txt", 2)]
        data = path.read_bytes()
        assert [data[m.offset : m.end] for m in members] == [b"abc", b"1", b"hi"]
        assert [s.key for s in group_samples(members, name)] == [long, "s1"]


def test_every_reader_finds_a_cut_header_at_the_same_spot(tmp_path: Path) -> None:
    """Cut 100 bytes into the header of shard 1's sample 60: scan, the reader without an .idx,
    verify and the re-shard source all name the same shard, key and byte offset."""
    root = _dataset(tmp_path / "ds")
    shard = "shard-000001.tar"
    key, header = _header_of(root, shard, 60)
    last_good = f"k{159:04d}"
    assert key == "k0160"
    os.truncate(root / shard, header + 100)
    want = ("truncated tar: header cut short", last_good, header)

    with pytest.raises(CorruptShardError) as scanned:
        scan_tar(LOCAL, str(root / shard))
    assert (scanned.value.reason, scanned.value.key, scanned.value.offset) == want

    (root / shard.replace(".tar", ".idx")).unlink()
    with pytest.raises(CorruptShardError) as read:
        TarShardReader(LOCAL, str(root / shard), shard)
    assert (read.value.reason, read.value.key, read.value.offset) == want

    walked = [p for p in verify_dataset(str(root)).problems if p.message.startswith("truncated")]
    assert [(p.message, p.key, p.offset) for p in walked] == [want]

    with pytest.raises(SourceReadError) as listed:
        open_source(str(root / "*.tar"), "tar").items()
    assert listed.value.path == str(root / shard)
    assert (listed.value.key, listed.value.offset) == (last_good, header)
    assert listed.value.reason.startswith("truncated tar: header cut short")


def test_archive_cut_between_two_members_is_truncated(tmp_path: Path) -> None:
    """No end-of-archive block: a copy cut exactly between members would otherwise lose the
    samples after the cut without a word (Python's tarfile stops quietly there)."""
    path = _tar(tmp_path / "a.tar", [("s0.txt", b"a" * 10), ("s1.txt", b"b" * 10), ("s2.txt", b"c" * 10)])
    os.truncate(path, 2 * 1024)  # s0 and s1 whole, nothing after
    with pytest.raises(CorruptShardError) as err:
        scan_tar(LOCAL, str(path))
    assert (err.value.reason, err.value.key, err.value.offset) == (
        "truncated tar: no end-of-archive blocks",
        "s1",
        2048,
    )
    with pytest.raises(SourceReadError, match="no end-of-archive blocks"):
        open_source(str(path), "tar").items()
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    with pytest.raises(CorruptShardError, match="empty file"):
        scan_tar(LOCAL, str(empty))


def test_a_member_cut_short_keeps_the_whole_sample_before_it(tmp_path: Path) -> None:
    path = _tar(
        tmp_path / "a.tar", [("s0.txt", b"a"), ("s0.cls", b"0"), ("s1.txt", b"b" * 600), ("s2.txt", b"c")]
    )
    header_s1 = 2 * 1024
    os.truncate(path, header_s1 + 512 + 100)  # inside s1's data
    reader = RangeReader(LOCAL, str(path), path.stat().st_size)
    got: list[IdxSample] = []
    with pytest.raises(CorruptShardError) as err:
        got.extend(group_samples(walk_tar(reader, "a.tar"), "a.tar"))
    reader.close()
    assert [s.key for s in got] == ["s0"]  # whole: the cut names another sample
    assert (err.value.reason, err.value.key, err.value.offset) == (
        "truncated tar: member 's1.txt' needs 600 bytes, only 100 present",
        "s1",
        header_s1,
    )
    src = open_source(str(path), "tar", on_error="skip")
    assert [s["__key__"] for s in src.read_many(src.items())] == ["s0"]
    assert src.skipped == [
        {
            "source": str(path),
            "error": "truncated tar: member 's1.txt' needs 600 bytes, only 100 present; this sample and "
            f"every one after it are left out (sample 's1', byte offset {header_s1})",
        }
    ]


def test_duplicates_raise_or_go_to_the_callback(tmp_path: Path) -> None:
    path = _tar(tmp_path / "d.tar", [("a.jpg", b"1"), ("a.jpg", b"2"), ("b.jpg", b"3"), ("a.cls", b"4")])
    with pytest.raises(DuplicateKeyError, match="member 'a.jpg' appears twice") as err:
        list(group_samples(_walk(path), "d.tar"))
    assert (err.value.key, err.value.offset) == ("a", 1024)
    found: list[DuplicateKeyError] = []
    samples = list(group_samples(_walk(path), "d.tar", on_duplicate=found.append))
    assert [(s.key, [m[0] for m in s.members]) for s in samples] == [
        ("a", ["jpg"]),
        ("b", ["jpg"]),
        ("a", ["cls"]),
    ]
    assert [(e.key, e.offset) for e in found] == [("a", 1024), ("a", 3072)]
    assert "must be contiguous" in found[1].reason


def test_non_sample_members_are_left_out_everywhere(tmp_path: Path) -> None:
    path = _tar(tmp_path / "m.tar", [("README", b"r"), ("d/.hidden", b"h"), ("s0.txt", b"t")])
    assert [m.name for m in _walk(path)] == ["README", "d/.hidden", "s0.txt"]
    assert [s.key for s in scan_tar(LOCAL, str(path))] == ["s0"]
    assert [s["__key__"] for s in open_dataset(str(path))] == ["s0"]
    src = open_source(str(path), "tar")
    assert [s["__key__"] for s in src.read_many(src.items())] == ["s0"]
