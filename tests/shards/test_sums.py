"""Per-member CRC32s written beside each tar (``.sums``) in the writer's own pass: ``verify`` names
the damaged sample, field and offset, and ``open_dataset(..., verify_samples=True)`` refuses a
damaged member when it is read (locally through pread, remotely through ranged reads)."""

from __future__ import annotations

import io
import json
import tarfile
import zlib
from pathlib import Path

import pytest
from PIL import Image

from stallfree.errors import ChecksumMismatchError, ManifestError, MissingShardError
from stallfree.loader.dataloader import DataLoader
from stallfree.shards.manifest.model import Manifest
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.shards.tar.idx import parse_idx
from stallfree.shards.tar.sums import parse_sums, render_sums, sums_path_for
from stallfree.shards.verify import verify_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.httpserve import serve_directory
from stallfree.testing.images import jpeg_bytes

N = 12


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return jpeg_bytes(N, seed=3, sizes=((160, 120),))


def write(root: Path, photos: list[bytes]) -> Path:
    with ShardWriter(str(root), format="tar", max_samples=5) as w:
        for i, jpg in enumerate(photos):
            w.write({"__key__": f"p{i:03d}", "jpg": jpg, "cls": i % 3, "txt": f"photo {i}"})
    return root


def member(root: Path, shard: str, row: int, field: str) -> tuple[str, int, int]:
    """(key, data offset, size) of one member, from the shard's .idx."""
    sample = parse_idx((root / shard.replace(".tar", ".idx")).read_text(), shard)[row]
    _, off, size, _ = next(m for m in sample.members if m[0] == field)
    return sample.key, off, size


def damage(root: Path, shard: str, offset: int, data: bytes) -> None:
    path = root / shard
    blob = bytearray(path.read_bytes())
    blob[offset : offset + len(data)] = data
    path.write_bytes(bytes(blob))


def test_the_writer_records_one_crc32_per_member_in_tar_order(tmp_path, photos):
    root = write(tmp_path / "ds", photos)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["checksums"] == "crc32"
    for shard in manifest["shards"]:
        with tarfile.open(root / shard["path"]) as t:
            want = [zlib.crc32(t.extractfile(m).read()) for m in t.getmembers()]
        got = parse_sums((root / sums_path_for(shard["path"])).read_bytes(), shard["path"])
        assert list(got) == want and len(want) == 3 * shard["samples"]


def test_parallel_writing_records_them_too_identically_for_any_worker_count(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"__key__": f"r{i:03d}", "txt": f"row {i}" * i}) + "\n" for i in range(20))
    )
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        shard_dataset(open_source(rows), str(out), max_samples=6, workers=workers, shuffle_seed=None)
        outs.append({p.name: p.read_bytes() for p in out.iterdir()})
        assert Manifest.load(str(out)).checksums == "crc32"
    assert outs[0] == outs[1] and sum(name.endswith(".sums") for name in outs[0]) == 4
    assert verify_dataset(str(tmp_path / "w2")).ok


def test_verify_names_the_sample_field_and_offset_where_the_shard_hash_could_not(tmp_path, photos):
    """The reported case: 64 zeroed bytes in the middle of a JPEG; PIL decodes it anyway, so
    ``--decode`` passed and the shard's sha256 said only which shard."""
    root = write(tmp_path / "ds", photos)
    key, off, size = member(root, "shard-000001.tar", 2, "jpg")
    at = off + size // 2
    damage(root, "shard-000001.tar", at, bytes(64))
    blob = (root / "shard-000001.tar").read_bytes()
    with Image.open(io.BytesIO(blob[off : off + size])) as im:
        im.load()  # still decodes: no decode check can tell
    report = verify_dataset(str(root), decode=True)
    found = [(p.error, p.shard, p.key, p.offset) for p in report.problems]
    assert found == [
        ("HashMismatchError", "shard-000001.tar", None, None),
        ("ChecksumMismatchError", "shard-000001.tar", key, off),
    ]
    assert report.problems[1].message.startswith(f"field 'jpg' ({size} bytes) has crc32 ")
    assert key == "p007"


def test_a_damaged_label_is_named_too(tmp_path, photos):
    root = write(tmp_path / "ds", photos)
    key, off, _ = member(root, "shard-000000.tar", 4, "cls")
    damage(root, "shard-000000.tar", off, b"7")
    problems = verify_dataset(str(root)).problems
    assert [(p.error, p.key, p.offset) for p in problems][1:] == [("ChecksumMismatchError", key, off)]
    assert problems[1].message.startswith("field 'cls' (1 bytes)")


def test_missing_or_wrong_sums_files_are_reported(tmp_path, photos):
    root = write(tmp_path / "ds", photos)
    (root / "shard-000000.sums").unlink()
    other = (root / "shard-000002.sums").read_bytes()
    (root / "shard-000001.sums").write_bytes(other)  # 2 samples' checksums for a 5-sample shard
    problems = [(p.error, p.shard, p.message) for p in verify_dataset(str(root)).problems]
    assert problems == [
        (
            "IndexMismatchError",
            "shard-000000.tar",
            "missing checksums shard-000000.sums: the manifest records them for every tar",
        ),
        (
            "IndexMismatchError",
            "shard-000001.tar",
            "shard-000001.sums holds 6 checksums, the tar has 15 members",
        ),
    ]
    (root / "shard-000002.sums").write_bytes(b"SFsm\x01")
    assert "too short for its header" in verify_dataset(str(root)).problems[-1].message


def test_verify_samples_refuses_a_damaged_member_when_read_and_serves_the_rest(tmp_path, photos):
    root = write(tmp_path / "ds", photos)
    ds = open_dataset(str(root), verify_samples=True)
    good = [ds[i] for i in range(N)]
    key, off, size = member(root, "shard-000001.tar", 2, "jpg")
    damage(root, "shard-000001.tar", off + size // 2, bytes(64))
    ds = open_dataset(str(root), verify_samples=True)
    with pytest.raises(ChecksumMismatchError) as info:
        ds[7]
    assert (info.value.shard, info.value.key, info.value.offset) == ("shard-000001.tar", key, off)
    assert [ds[i] for i in range(N) if i != 7] == [s for i, s in enumerate(good) if i != 7]
    assert open_dataset(str(root))[7]["__key__"] == key  # without the option: not checked
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, on_error="skip", collate_fn=lambda b: [s["__key__"] for s in b]
    )
    assert sorted(k for batch in loader for k in batch) == sorted(f"p{i:03d}" for i in range(N) if i != 7)


def test_verify_samples_over_http_checks_the_ranged_reads(tmp_path, photos):
    root = write(tmp_path / "ds", photos)
    key, off, _ = member(root, "shard-000002.tar", 0, "txt")
    damage(root, "shard-000002.tar", off, b"X")
    with serve_directory(tmp_path) as server:
        ds = open_dataset(server.url + "/ds", verify_samples=True)
        assert [s["__key__"] for s in ds.get_many([0, 5, 9])] == ["p000", "p005", "p009"]
        with pytest.raises(ChecksumMismatchError, match="field 'txt'") as info:
            ds.get_many([10, 11])
        assert info.value.key == key == "p010"


def test_verify_samples_needs_checksums(tmp_path, photos):
    with ShardWriter(str(tmp_path / "arrow"), format="arrow") as w:
        w.write({"__key__": "a", "cls": 1})
    with pytest.raises(ManifestError, match="verify_samples=True needs the per-sample checksums"):
        open_dataset(str(tmp_path / "arrow"), verify_samples=True)
    root = write(tmp_path / "ds", photos)
    (root / "manifest.json").unlink()  # plain tars: indexed on the fly, no checksums
    with pytest.raises(ManifestError, match="this tar dataset has none"):
        open_dataset(str(root), verify_samples=True)


def test_a_missing_sums_file_is_named_when_the_shard_opens(tmp_path, photos):
    root = write(tmp_path / "ds", photos)
    (root / "shard-000001.sums").unlink()
    ds = open_dataset(str(root), verify_samples=True)
    assert ds[0]["__key__"] == "p000"
    with pytest.raises(MissingShardError, match="missing checksums shard-000001.sums"):
        ds[5]


def test_the_sums_format_and_the_manifest_field():
    data = render_sums(__import__("array").array("I", [0, 1, 2**32 - 1]))
    assert data[:4] == b"SFsm" and len(data) == 16 + 12
    assert list(parse_sums(data, "s.tar")) == [0, 1, 2**32 - 1]
    with pytest.raises(Exception, match="header says 3 checksums"):
        parse_sums(data[:-1], "s.tar")
    base = {"version": 1, "format": "tar", "fields": [], "shards": []}
    assert Manifest.from_json({**base, "checksums": "crc32"}).checksums == "crc32"
    assert "checksums" not in Manifest.from_json(base).to_json()
    with pytest.raises(ManifestError, match="unknown per-sample checksum 'md5'"):
        Manifest.from_json({**base, "checksums": "md5"})
