"""The digests a manifest records (``digests.py``): every writer records sha256 and xxh3-128 of
exactly the bytes of each shard, ``stallfree index`` too, and a malformed one is refused."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import fsspec
import pytest
import xxhash

from stallfree.errors import ManifestError
from stallfree.shards.manifest.model import Manifest, ShardInfo
from stallfree.shards.scan import digests_of, manifest_for_tars
from stallfree.shards.writer import ShardWriter


def _file_digests(path: Path) -> tuple[str, str]:
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest(), xxhash.xxh3_128(data).hexdigest()


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_every_written_shard_records_both_digests_of_its_bytes(tmp_path: Path, fmt: str) -> None:
    root = tmp_path / "ds"
    with ShardWriter(str(root), format=fmt, max_samples=3) as w:
        for i in range(8):  # 3 shards; big enough samples to pass the overlapped hasher's chunk
            w.write({"__key__": f"k{i}", "bin": os.urandom(3_000_000 + i), "cls": i})
    manifest = Manifest.load(str(root))
    assert len(manifest.shards) == 3
    for info in manifest.shards:
        assert (info.sha256, info.xxh3_128) == _file_digests(root / info.path)


def test_index_records_both_digests_when_asked_for_hashes(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    with ShardWriter(str(root), format="tar", max_samples=4) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "bin": os.urandom(1000 + i)})
    fs = fsspec.filesystem("file")
    paths = sorted(str(p) for p in root.glob("*.tar"))
    manifest, _ = manifest_for_tars(fs, str(root), paths, hashes=True)
    for info in manifest.shards:
        assert (info.sha256, info.xxh3_128) == _file_digests(root / info.path)
    plain, _ = manifest_for_tars(fs, str(root), paths, hashes=False)
    assert all(i.sha256 is None and i.xxh3_128 is None for i in plain.shards)
    d = digests_of(fs, paths[0], chunk=64)  # many small reads: the same digests
    assert (d.sha256(), d.xxh3_128()) == _file_digests(Path(paths[0]))


@pytest.mark.parametrize("bad", ["ab" * 15, "zz" * 16, 123, "AB" * 17])
def test_a_malformed_xxh3_128_is_refused_naming_the_shard(bad: object) -> None:
    entry = {"path": "a.tar", "samples": 1, "bytes": 10, "sha256": None, "xxh3_128": bad}
    with pytest.raises(ManifestError, match=r"shard a\.tar: xxh3_128 must be 32 hex digits"):
        ShardInfo.from_json(entry)


def test_a_manifest_without_it_reads_and_writes_as_before() -> None:
    entry = {"path": "a.tar", "samples": 1, "bytes": 10, "sha256": "0" * 64}
    info = ShardInfo.from_json(entry)
    assert info.xxh3_128 is None and info.to_json() == entry
