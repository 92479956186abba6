"""``OverlappedHashFile`` (sha256 on a helper thread reading the file back, one ``writev`` per
sample) writes exactly what ``AtomicFile`` writes, with the same digest, the same
temp-then-rename and the same errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import fsspec
import pytest

from stallfree.errors import WriteError
from stallfree.shards.tar.writer import TarShardWriter
from stallfree.storage import atomic
from stallfree.storage.atomic import AtomicFile, OverlappedHashFile

from .conftest import make_samples

LOCAL = fsspec.filesystem("file")


def _parts() -> list:
    big = os.urandom(300_000)
    return [b"head" * 128, big, bytearray(b"pad" * 7), memoryview(big)[1000:9000], b"", b"tail"]


def test_parts_land_in_order_with_the_same_digest(tmp_path: Path) -> None:
    parts = _parts()
    want = b"".join(bytes(p) for p in parts)
    plain = AtomicFile(LOCAL, str(tmp_path / "plain.bin"))
    fast = OverlappedHashFile(LOCAL, str(tmp_path / "fast.bin"))
    for f in (plain, fast):
        f.write_parts(parts[:3])
        f.write(parts[3])
        f.write_parts(parts[4:])
        assert f.size == len(want)
        f.commit()
    assert (tmp_path / "fast.bin").read_bytes() == (tmp_path / "plain.bin").read_bytes() == want
    assert fast.sha256() == plain.sha256() == hashlib.sha256(want).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.bin", "plain.bin"]  # no temp left


def test_many_parts_and_short_writes(tmp_path: Path, monkeypatch) -> None:
    parts = [bytes([i % 251]) * (i % 700 + 1) for i in range(2000)]  # more than one writev takes
    want = b"".join(parts)
    real_writev = os.writev
    monkeypatch.setattr(atomic.os, "writev", lambda fd, bufs: real_writev(fd, bufs[:3]))  # short writes
    f = OverlappedHashFile(LOCAL, str(tmp_path / "x.bin"))
    f.write_parts(parts[:100])
    f.write_parts(parts[100:])
    f.commit()
    assert (tmp_path / "x.bin").read_bytes() == want
    assert f.sha256() == hashlib.sha256(want).hexdigest()


@pytest.mark.parametrize("lag", [1, 4, 10**9])  # 1: the writer hashes most chunks itself; 10**9: never
@pytest.mark.parametrize("chunk", [97, 1000, 4096, 1 << 20])
def test_digest_across_read_back_chunk_sizes(tmp_path: Path, monkeypatch, chunk: int, lag: int) -> None:
    monkeypatch.setattr(OverlappedHashFile, "chunk", chunk)
    monkeypatch.setattr(OverlappedHashFile, "lag", lag)
    parts = [os.urandom(i * 37 % 5000) for i in range(300)]
    f = OverlappedHashFile(LOCAL, str(tmp_path / "x.bin"))
    for i in range(0, 300, 7):
        f.write_parts(parts[i : i + 7])
    f.commit()
    want = b"".join(parts)
    assert (tmp_path / "x.bin").read_bytes() == want
    assert f.sha256() == hashlib.sha256(want).hexdigest()


def test_failed_read_back_is_a_write_error_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    def broken(fd, buffers, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(OverlappedHashFile, "chunk", 1000)
    monkeypatch.setattr(atomic.os, "preadv", broken)
    with pytest.raises(WriteError, match="sha256 read-back failed: OSError"):
        with _OverlappedTar(str(tmp_path / "x.tar")) as w:
            w.write({"__key__": "a", "bin": b"x" * 5000})
    assert list(tmp_path.iterdir()) == []


def test_remote_filesystem_hashes_inline() -> None:
    fs = fsspec.filesystem("memory")
    f = OverlappedHashFile(fs, "/stallfree-wp/x.bin")
    parts = _parts()
    f.write_parts(parts)
    f.commit()
    want = b"".join(bytes(p) for p in parts)
    assert fs.cat_file("/stallfree-wp/x.bin") == want
    assert f.sha256() == hashlib.sha256(want).hexdigest()
    fs.rm("/stallfree-wp", recursive=True)


def test_failed_write_raises_write_error_and_leaves_nothing(tmp_path: Path) -> None:
    f = OverlappedHashFile(LOCAL, str(tmp_path / "x.bin"))
    f.write(b"a" * 5000)
    readonly = os.open(os.devnull, os.O_RDONLY)
    f._fd = readonly  # writes now go to a descriptor that refuses them
    try:
        with pytest.raises(WriteError, match="write failed: OSError") as info:
            f.write_parts([b"b" * 5000])
    finally:
        os.close(readonly)
    assert info.value.offset == 5000
    assert list(tmp_path.iterdir()) == []
    assert f._f.closed  # abort closed the real file


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    f = OverlappedHashFile(LOCAL, str(tmp_path / "x.bin"))
    f.write_parts(_parts())
    f.abort()
    assert list(tmp_path.iterdir()) == []


class _OverlappedTar(TarShardWriter):
    file_class = OverlappedHashFile


def test_tar_writer_with_overlapped_file_is_byte_identical(tmp_path: Path) -> None:
    samples = make_samples(12, size=6000)
    infos = []
    for cls, name in ((TarShardWriter, "plain"), (_OverlappedTar, "fast")):
        with cls(str(tmp_path / f"{name}.tar")) as w:
            for s in samples:
                w.write(s)
        infos.append(w.info)
    for ext in ("tar", "idx"):
        assert (tmp_path / f"fast.{ext}").read_bytes() == (tmp_path / f"plain.{ext}").read_bytes()
    assert (
        infos[0].sha256 == infos[1].sha256 == hashlib.sha256((tmp_path / "fast.tar").read_bytes()).hexdigest()
    )
    assert infos[0].bytes == infos[1].bytes and infos[0].samples == infos[1].samples == 12


@pytest.mark.parametrize("cls", [AtomicFile, OverlappedHashFile])
def test_failed_rename_raises_write_error_and_leaves_nothing(tmp_path: Path, cls) -> None:
    target = tmp_path / "x.bin"
    (target / "inside").mkdir(parents=True)  # a non-empty directory where the file should go
    f = cls(LOCAL, str(target))
    f.write(b"a" * 5000)
    with pytest.raises(WriteError, match=f"cannot finish {target}: (IsADirectoryError|OSError)") as info:
        f.commit()
    assert info.value.shard == "x.bin"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"] and target.is_dir()
