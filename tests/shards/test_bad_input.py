"""Every kind of bad input raises our own error type, naming shard, sample key and byte offset."""

import io
import json
import os
import tarfile

import pytest

from stallfree.errors import (
    ChecksumMismatchError,
    CorruptShardError,
    DuplicateKeyError,
    HashMismatchError,
    IndexMismatchError,
    ManifestError,
    MissingShardError,
    ShardError,
    WriteError,
)
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter

from .conftest import make_samples

SHARD1 = "shard-000001.tar"


def _idx_line(root, shard, row):
    """(key, [(field, offset, size)]) of one sample from the .idx our writer wrote."""
    line = (root / shard.replace(".tar", ".idx")).read_text().splitlines()[row + 1].split()
    groups = [line[j : j + 4] for j in range(0, len(line), 4)]
    return groups[0][3].split(".")[0], [(g[0], int(g[1]), int(g[2])) for g in groups]


def test_truncated_tar_with_manifest(tar_dataset):
    path = tar_dataset / SHARD1
    size = path.stat().st_size
    os.truncate(path, size // 2)
    ds = open_dataset(str(tar_dataset))
    assert ds[0]["__key__"] == "sample00000"  # other shards unaffected
    with pytest.raises(CorruptShardError, match="truncated") as info:
        ds[7]
    assert info.value.shard == SHARD1 and info.value.offset == size // 2


def test_truncated_tar_without_manifest_or_idx(tar_dataset):
    os.remove(tar_dataset / "manifest.json")
    key, members = _idx_line(tar_dataset, SHARD1, 2)
    for f in tar_dataset.glob("*.idx"):
        f.unlink()
    jpg_offset = dict((f, o) for f, o, _ in members)["jpg"]
    os.truncate(tar_dataset / SHARD1, jpg_offset + 100)  # cut inside sample 2's jpg
    with pytest.raises(CorruptShardError, match="truncated tar: member 'sample00007.jpg'") as info:
        open_dataset(str(tar_dataset))
    assert (info.value.shard, info.value.key, info.value.offset) == (SHARD1, key, jpg_offset - 512)


def test_truncated_tar_with_idx_but_no_manifest(tar_dataset):
    os.remove(tar_dataset / "manifest.json")
    key, members = _idx_line(tar_dataset, SHARD1, 4)
    os.truncate(tar_dataset / SHARD1, members[1][1] + 10)
    ds = open_dataset(str(tar_dataset))  # counts come from the .idx files
    with pytest.raises(CorruptShardError, match="truncated tar") as info:
        ds[5]
    assert (info.value.shard, info.value.key, info.value.offset) == (SHARD1, key, members[1][1] - 512)


def test_corrupt_header_found_by_scan_and_verify(tar_dataset):
    key, members = _idx_line(tar_dataset, SHARD1, 3)
    header = members[0][1] - 512
    with open(tar_dataset / SHARD1, "r+b") as f:
        f.seek(header)
        f.write(b"\xff" * 20)
    problems = open_dataset(str(tar_dataset)).verify(hashes=False)
    assert len(problems) == 1 and isinstance(problems[0], CorruptShardError)
    assert (problems[0].shard, problems[0].key, problems[0].offset) == (SHARD1, key, header)
    assert "checksum" in str(problems[0])
    os.remove(tar_dataset / "manifest.json")
    for f in tar_dataset.glob("*.idx"):
        f.unlink()
    with pytest.raises(CorruptShardError, match="corrupt tar header") as info:
        open_dataset(str(tar_dataset))
    # the bad header belongs to sample00008; the last good key read before it is sample00007
    assert (info.value.shard, info.value.key, info.value.offset) == (SHARD1, "sample00007", header)


def test_corrupt_first_header_with_idx(tar_dataset):
    with open(tar_dataset / SHARD1, "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(IndexMismatchError, match="no valid tar header") as info:
        open_dataset(str(tar_dataset))[5]
    assert (info.value.shard, info.value.key, info.value.offset) == (SHARD1, "sample00005", 0)


def test_idx_that_disagrees_with_its_tar(tar_dataset):
    idx = tar_dataset / SHARD1.replace(".tar", ".idx")
    lines = idx.read_text().splitlines()
    first, second = lines[1].split(), lines[2].split()
    for j in (1, 2, 5, 6, 9, 10):  # sample00005's entries now point at sample00006's members
        first[j] = second[j]
    lines[1] = " ".join(first)
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(IndexMismatchError, match="the tar has 'sample00006.cls'") as info:
        open_dataset(str(tar_dataset))[5]
    assert (info.value.shard, info.value.key) == (SHARD1, "sample00005")
    assert info.value.offset == int(second[1]) - 512


def test_idx_offset_past_end(tar_dataset):
    idx = tar_dataset / SHARD1.replace(".tar", ".idx")
    lines = idx.read_text().splitlines()
    parts = lines[3].split()
    parts[5] = "99999999"  # jpg member's offset
    lines[3] = " ".join(parts)
    idx.write_text("\n".join(lines) + "\n")
    # the tar is whole (its size matches the manifest, its headers walk to the end): the index is wrong
    with pytest.raises(
        IndexMismatchError, match="ends at byte .* the index does not belong to this tar"
    ) as info:
        open_dataset(str(tar_dataset))[5]
    assert (info.value.shard, info.value.key, info.value.offset) == (SHARD1, "sample00007", 99999999 - 512)


def test_idx_count_disagrees_with_manifest(tar_dataset):
    idx = tar_dataset / SHARD1.replace(".tar", ".idx")
    lines = idx.read_text().splitlines()
    idx.write_text("\n".join(["v1.2 4"] + lines[1:5]) + "\n")
    with pytest.raises(IndexMismatchError, match="lists 4 samples, the manifest says 5") as info:
        open_dataset(str(tar_dataset))[5]
    assert info.value.shard == SHARD1


def test_remote_read_checks_every_member_header(tar_dataset):
    import fsspec

    mem = fsspec.filesystem("memory")
    for f in tar_dataset.iterdir():
        mem.pipe_file(f"/badidx/{f.name}", f.read_bytes())
    lines = mem.cat_file(f"/badidx/{SHARD1.replace('.tar', '.idx')}").decode().splitlines()
    lines[3] = lines[3].replace("sample00007", "sample00008")  # two middle samples' names swapped
    lines[4] = lines[4].replace("sample00008", "sample00007")
    mem.pipe_file(f"/badidx/{SHARD1.replace('.tar', '.idx')}", ("\n".join(lines) + "\n").encode())
    ds = open_dataset("memory://badidx")
    assert ds[5]["__key__"] == "sample00005"
    with pytest.raises(IndexMismatchError, match="the tar has b'sample00007.cls'") as info:
        ds[7]
    assert (info.value.shard, info.value.key) == (SHARD1, "sample00008")


def test_hash_mismatch(tar_dataset):
    path = tar_dataset / SHARD1
    data = bytearray(path.read_bytes())
    _, members = _idx_line(tar_dataset, SHARD1, 0)
    data[members[1][1]] ^= 0x01  # one bit of sample00005's jpg; size unchanged
    path.write_bytes(bytes(data))
    assert open_dataset(str(tar_dataset))[5]["__key__"] == "sample00005"  # not checked unless asked
    ds = open_dataset(str(tar_dataset), verify_hashes=True)
    assert ds[0]["__key__"] == "sample00000"
    with pytest.raises(HashMismatchError, match="sha256 is") as info:
        ds[5]
    assert info.value.shard == SHARD1
    problems = ds.verify()
    # the shard's sha256, and the per-member CRC32 naming the damaged sample
    assert [(type(p), p.shard) for p in problems] == [
        (HashMismatchError, SHARD1),
        (ChecksumMismatchError, SHARD1),
    ]
    assert problems[1].key == "sample00005"


def test_missing_shard(tar_dataset):
    os.remove(tar_dataset / "shard-000002.tar")
    ds = open_dataset(str(tar_dataset))
    assert ds[9]["__key__"] == "sample00009"
    with pytest.raises(MissingShardError, match="shard not found") as info:
        ds[10]
    assert info.value.shard == "shard-000002.tar"
    assert [(type(p), p.shard) for p in ds.verify()] == [(MissingShardError, "shard-000002.tar")]


def test_manifest_of_unknown_version(tar_dataset):
    obj = json.loads((tar_dataset / "manifest.json").read_text())
    obj["version"] = 2
    (tar_dataset / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match="unknown manifest format version 2") as info:
        open_dataset(str(tar_dataset))
    assert str(tar_dataset / "manifest.json") in str(info.value)


def test_duplicate_key_in_foreign_tar(tmp_path):
    buf = tmp_path / "dup.tar"
    with tarfile.open(buf, "w", format=tarfile.USTAR_FORMAT) as t:
        for name in ("a.jpg", "b.jpg", "a.cls"):
            info = tarfile.TarInfo(name)
            info.size = 3
            t.addfile(info, io.BytesIO(b"xyz"))
    with pytest.raises(DuplicateKeyError, match="appears twice") as err:
        open_dataset(str(buf))
    assert (err.value.shard, err.value.key, err.value.offset) == ("dup.tar", "a", 2048)


def test_duplicate_key_when_writing(tmp_path):
    with pytest.raises(DuplicateKeyError) as err, ShardWriter(str(tmp_path), format="arrow") as w:
        for s in make_samples(3) + make_samples(1):
            w.write(s)
    assert (err.value.shard, err.value.key) == ("shard-000000.arrow", "sample00000")
    assert os.listdir(tmp_path) == []


def test_unwritable_destination(tmp_path):
    (tmp_path / "blocker").write_bytes(b"")
    with pytest.raises(WriteError, match="not writable"):
        ShardWriter(str(tmp_path / "blocker" / "sub"), format="arrow")


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_nothing_partial_under_a_final_name(tmp_path, fmt):
    samples = make_samples(9)

    def failing():
        yield from samples[:7]
        raise OSError("source disk went away")

    with pytest.raises(OSError), ShardWriter(str(tmp_path), format=fmt, max_samples=3) as w:
        for s in failing():
            w.write(s)
    ext = ".tar" if fmt == "tar" else ".arrow"
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if n.endswith(ext)] == [f"shard-000000{ext}", f"shard-000001{ext}"]
    assert "manifest.json" not in names and not [n for n in names if n.startswith(".")]


def test_truncated_arrow(arrow_dataset):
    path = arrow_dataset / "shard-000001.arrow"
    os.truncate(path, path.stat().st_size - 100)
    ds = open_dataset(str(arrow_dataset))
    with pytest.raises(CorruptShardError, match="truncated") as info:
        ds[6]
    assert info.value.shard == "shard-000001.arrow"
    os.remove(arrow_dataset / "manifest.json")
    with pytest.raises(CorruptShardError, match="not a readable Arrow IPC file") as info:
        open_dataset(str(arrow_dataset))
    assert info.value.shard == "shard-000001.arrow"


def test_errors_are_shard_errors():
    for cls in (CorruptShardError, IndexMismatchError, HashMismatchError, MissingShardError, ManifestError):
        assert issubclass(cls, ShardError)


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_shard_larger_than_recorded(tar_dataset, arrow_dataset, fmt):
    root, name = (tar_dataset, SHARD1) if fmt == "tar" else (arrow_dataset, "shard-000001.arrow")
    path = root / name
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\0" * 512)
    ds = open_dataset(str(root))
    with pytest.raises(CorruptShardError, match=f"larger than recorded: {size + 512} bytes") as info:
        ds[5]
    assert (info.value.shard, info.value.offset) == (name, size + 512)


@pytest.mark.parametrize("with_manifest", [True, False])
def test_idx_of_another_tar_is_an_index_mismatch(tmp_path, with_manifest):
    """A whole tar with the .idx of a bigger one: the index is wrong, not the tar truncated."""
    small, big = tmp_path / "small", tmp_path / "big"
    for root, n in ((small, 3), (big, 8)):
        with ShardWriter(str(root), max_samples=10) as w:
            for s in make_samples(n):
                w.write(s)
    name = "shard-000000.tar"
    (small / "shard-000000.idx").write_bytes((big / "shard-000000.idx").read_bytes())
    if not with_manifest:
        os.remove(small / "manifest.json")
    else:  # the manifest's count agrees with the borrowed index, so only the offsets can tell
        obj = json.loads((small / "manifest.json").read_text())
        obj["shards"][0]["samples"] = 8
        (small / "manifest.json").write_text(json.dumps(obj))
    size = (small / name).stat().st_size
    key, members = _idx_line(big, name, 3)  # sample00003's jpg: the first entry past the small tar's end
    (_, off, length) = members[1]
    assert members[1][0] == "jpg" and off + length > size >= members[0][1] + members[0][2]
    with pytest.raises(IndexMismatchError, match="the index does not belong to this tar") as info:
        open_dataset(str(small))[0]
    assert (info.value.shard, info.value.key, info.value.offset) == (name, key, off - 512)
    assert "the tar ends at byte" in info.value.reason


def test_deeply_nested_json_in_a_source_is_a_typed_error_naming_it(tmp_path):
    """A JSONL row, or a directory's index.json, nested 100,000 deep made ``json.loads`` raise
    RecursionError out of ``stallfree shard``; now the row is a SourceReadError naming the file
    and line, and the index.json is simply not an MDS / LitData one."""
    from stallfree.shards.sources.registry import SourceReadError, detect_kind, open_source

    deep = "[" * 100_000 + "]" * 100_000
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"__key__": "a", "x": 1}\n{"__key__": "b", "x": ' + deep + "}\n")
    source = open_source(str(rows))
    first, second = source.read_many(source.items())
    assert first == {"__key__": "a", "x": 1}
    assert isinstance(second, SourceReadError) and second.path == str(rows)
    assert "line 2 is not valid JSON" in str(second) and "nested too deeply" in str(second)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "index.json").write_text(deep)
    (odd / "a.txt").write_text("x")
    assert detect_kind([str(odd)]) == "files"
