"""A shard that fails its open-time checks leaves nothing open: no file descriptor, no mapping,
no remote file object, even while the error (and its traceback, which references the half-built
reader) is still alive, as it is when the loader keeps failures for its error policy."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.http import HTTPFileSystem

from stallfree.errors import CorruptShardError, HashMismatchError, IndexMismatchError
from stallfree.shards.arrow import reader as arrow_reader
from stallfree.shards.arrow.reader import ArrowShardReader
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.open import open_dataset
from stallfree.shards.tar.reader import TarShardReader
from stallfree.storage import remote
from stallfree.testing.httpserve import serve_directory

TAR = "shard-000001.tar"
ARROW = "shard-000001.arrow"


def open_fds(path: Path) -> list[int]:
    """This process's file descriptors open on ``path``."""
    target = os.path.realpath(path)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                out.append(int(fd))
        except OSError:  # the listing's own descriptor is gone by now
            continue
    return out


def mapped(path: Path) -> bool:
    """Whether any part of ``path`` is memory-mapped into this process."""
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + target) for line in f)


def shard_info(root: Path, name: str) -> ShardInfo:
    manifest = json.loads((root / "manifest.json").read_text())
    (entry,) = [s for s in manifest["shards"] if s["path"] == name]
    return ShardInfo(entry["path"], entry["samples"], entry["bytes"], entry["sha256"])


def assert_released(path: Path) -> None:
    """No descriptor now; no mapping once Arrow's own threads let go of it (they can hold the
    region for a moment after ``close``: seen up to ~4 ms; Python's mmap unmaps at once)."""
    assert open_fds(path) == []
    deadline = time.monotonic() + 10
    while mapped(path) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not mapped(path)


def test_the_probes_see_an_open_reader(tar_dataset, arrow_dataset):
    """The checks below would notice a leak: an open reader shows up in both, a closed one in neither."""
    fs = fsspec.filesystem("file")
    for root, name, cls in ((tar_dataset, TAR, TarShardReader), (arrow_dataset, ARROW, ArrowShardReader)):
        path = root / name
        reader = cls(fs, str(path), name, shard_info(root, name))
        # tar shards are read with pread (a descriptor), Arrow files through Arrow's memory map
        assert open_fds(path) and mapped(path) == (cls is ArrowShardReader)
        reader.close()
        assert_released(path)


# -- tar and Arrow alike, local (a descriptor; Arrow: and a memory map) --------------------------------------------------

LOCAL = pytest.mark.parametrize(
    "fixture, name, cls",
    [("tar_dataset", TAR, TarShardReader), ("arrow_dataset", ARROW, ArrowShardReader)],
    ids=["tar", "arrow"],
)


@LOCAL
def test_truncated_shard_releases_the_file(request, fixture, name, cls):
    root = request.getfixturevalue(fixture)
    path, info = root / name, shard_info(root, name)
    os.truncate(path, info.bytes - 100)
    with pytest.raises(CorruptShardError, match="shard is truncated") as err:
        cls(fsspec.filesystem("file"), str(path), name, info)
    assert (err.value.shard, err.value.offset) == (name, info.bytes - 100)
    assert_released(path)


@LOCAL
def test_hash_mismatch_releases_the_file(request, fixture, name, cls):
    root = request.getfixturevalue(fixture)
    path, info = root / name, shard_info(root, name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other hash
    path.write_bytes(bytes(data))
    with pytest.raises(HashMismatchError, match=f"the manifest says {info.sha256}") as err:
        cls(fsspec.filesystem("file"), str(path), name, info, verify_hash=True)
    assert err.value.shard == name
    assert_released(path)


# -- tar, local (memory-mapped) ------------------------------------------------------------------


def test_tar_bad_idx_releases_the_mapping(tar_dataset):
    path = tar_dataset / TAR
    idx = tar_dataset / TAR.replace(".tar", ".idx")
    lines = idx.read_text().splitlines()
    idx.write_text("\n".join(["v1.2 4"] + lines[1:5]) + "\n")
    with pytest.raises(IndexMismatchError, match="lists 4 samples, the manifest says 5") as err:
        TarShardReader(fsspec.filesystem("file"), str(path), TAR, shard_info(tar_dataset, TAR))
    assert err.value.shard == TAR
    assert_released(path)
    idx.write_text("v1.2 5\n" + "x 1 2\n" * 5)
    with pytest.raises(IndexMismatchError, match="expected groups of") as err:
        TarShardReader(fsspec.filesystem("file"), str(path), TAR, shard_info(tar_dataset, TAR))
    assert err.value.shard == TAR
    assert_released(path)


def test_tar_bad_first_header_releases_the_mapping(tar_dataset):
    path = tar_dataset / TAR
    with open(path, "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(IndexMismatchError, match="no valid tar header") as err:
        TarShardReader(fsspec.filesystem("file"), str(path), TAR, shard_info(tar_dataset, TAR))
    assert (err.value.shard, err.value.key, err.value.offset) == (TAR, "sample00005", 0)
    assert_released(path)


def test_tar_failure_through_open_dataset_releases_the_mapping(tar_dataset):
    path = tar_dataset / TAR
    os.truncate(path, shard_info(tar_dataset, TAR).bytes - 512)
    ds = open_dataset(str(tar_dataset))
    with pytest.raises(CorruptShardError, match="shard is truncated") as err:
        ds[5]
    assert err.value.shard == TAR
    assert_released(path)
    problems = ds.verify(hashes=True)  # the one verifier: the size, and so the hash, differ
    assert [(type(p), p.shard) for p in problems] == [(CorruptShardError, TAR), (HashMismatchError, TAR)]
    assert_released(path)
    assert ds[0]["__key__"] == "sample00000"  # the other shards still read
    ds.close()


# -- Arrow, local (memory-mapped) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [b"\x00", b"not arrow at all", b"ARROW1\x00\x00"],  # the last: right magic, no valid footer
)
def test_arrow_unreadable_file_releases_the_source(arrow_dataset, garbage):
    path = arrow_dataset / ARROW
    info = shard_info(arrow_dataset, ARROW)
    path.write_bytes((garbage * info.bytes)[: info.bytes])  # right size, not an IPC file
    with pytest.raises(CorruptShardError, match="not a readable Arrow IPC file") as err:
        ArrowShardReader(fsspec.filesystem("file"), str(path), ARROW, info)
    assert err.value.shard == ARROW
    assert_released(path)


def test_arrow_row_count_mismatch_releases_the_source(arrow_dataset):
    path = arrow_dataset / ARROW
    info = shard_info(arrow_dataset, ARROW)
    wrong = ShardInfo(info.path, info.samples + 1, info.bytes, info.sha256)
    with pytest.raises(IndexMismatchError, match="the file holds 5 rows, the manifest says 6") as err:
        ArrowShardReader(fsspec.filesystem("file"), str(path), ARROW, wrong)
    assert err.value.shard == ARROW
    assert_released(path)


# -- Arrow, remote (``remote.RangeFile`` over the loopback HTTP server) ----------------------------


class RecordingRangeFile(remote.RangeFile):
    """The remote file the reader reads through, keeping every instance made."""

    made: list = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        RecordingRangeFile.made.append(self)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("handles-http")
    with serve_directory(root) as server:
        yield server, root


@pytest.fixture
def remote_arrow(served, arrow_dataset, request, monkeypatch):
    """``(fs, url, info, local path)``: shard 1 of the Arrow dataset, served under this test's name."""
    server, root = served
    name = f"{request.node.name}.arrow"
    shutil.copyfile(arrow_dataset / ARROW, root / name)
    monkeypatch.setattr(arrow_reader, "RangeFile", RecordingRangeFile)
    RecordingRangeFile.made = []
    fs = HTTPFileSystem(skip_instance_cache=True)
    return fs, f"{server.url}/{name}", shard_info(arrow_dataset, ARROW), root / name


def closed(fs: HTTPFileSystem) -> list[bool]:
    return [f.closed for f in RecordingRangeFile.made]


def test_remote_arrow_reader_closes_its_file(remote_arrow):
    fs, url, info, _ = remote_arrow
    reader = ArrowShardReader(fs, url, ARROW, info)
    assert reader.get(0)["__key__"] == "sample00005"
    assert closed(fs) == [False]
    reader.close()
    assert closed(fs) == [True]


def test_remote_arrow_truncated_shard_closes_its_file(remote_arrow):
    fs, url, info, path = remote_arrow
    os.truncate(path, info.bytes - 100)
    with pytest.raises(CorruptShardError, match="shard is truncated") as err:
        ArrowShardReader(fs, url, ARROW, info)
    assert (err.value.shard, err.value.offset) == (ARROW, info.bytes - 100)
    assert closed(fs) == [True]


def test_remote_arrow_hash_mismatch_closes_its_files(remote_arrow):
    fs, url, info, path = remote_arrow
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(HashMismatchError, match=f"the manifest says {info.sha256}") as err:
        ArrowShardReader(fs, url, ARROW, info, verify_hash=True)
    assert err.value.shard == ARROW
    assert closed(fs) == [True]  # the hash pass reads checked ranges, no file


def test_remote_arrow_unreadable_file_closes_its_file(remote_arrow):
    fs, url, info, path = remote_arrow
    path.write_bytes(b"\x00" * info.bytes)
    with pytest.raises(CorruptShardError, match="not a readable Arrow IPC file") as err:
        ArrowShardReader(fs, url, ARROW, info)
    assert err.value.shard == ARROW
    assert closed(fs) == [True]


def test_remote_arrow_row_count_mismatch_closes_its_file(remote_arrow):
    fs, url, info, _ = remote_arrow
    wrong = ShardInfo(info.path, info.samples - 1, info.bytes, info.sha256)
    with pytest.raises(IndexMismatchError, match="the file holds 5 rows, the manifest says 4") as err:
        ArrowShardReader(fs, url, ARROW, wrong)
    assert err.value.shard == ARROW
    assert closed(fs) == [True]


# -- an Arrow table source (``stallfree shard`` input) ---------------------------------------------


def test_unreadable_arrow_source_file_releases_its_mapping(tmp_path):
    from stallfree.shards.sources.registry import SourceReadError, open_source

    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"not arrow at all" * 64)
    source = open_source(bad)
    with pytest.raises(SourceReadError, match="not a readable Arrow IPC file") as err:
        source.items()
    assert err.value.path == str(bad)
    assert_released(bad)
    with pytest.raises(CorruptShardError, match="not a readable Arrow IPC file") as err2:
        source.schema()
    assert err2.value.shard == str(bad)
    assert_released(bad)
