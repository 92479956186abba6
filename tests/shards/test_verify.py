"""``verify_dataset`` finds each kind of damage and names the shard, key and offset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.shards.tar.idx import parse_idx
from stallfree.shards.verify import verify_dataset
from stallfree.testing.images import make_image_folder


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("verify")
    src = make_image_folder(base / "imf", classes=2, per_class=4, sizes=((48, 40),))
    shard_dataset(open_source(src), str(base / "tar"), max_samples=3)
    shard_dataset(open_source(src), str(base / "arrow"), format="arrow", max_samples=3)
    return base


@pytest.fixture
def copy(dataset: Path, tmp_path: Path):
    def make(fmt: str = "tar") -> Path:
        return Path(shutil.copytree(dataset / fmt, tmp_path / fmt))

    return make


def errors(report) -> list[tuple[str, str | None]]:
    return [(p.error, p.shard) for p in report.problems]


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_intact_dataset_is_ok(dataset: Path, fmt: str) -> None:
    report = verify_dataset(str(dataset / fmt), decode=True)
    assert report.ok, report.problems
    assert (report.shards, report.samples, report.decoded) == (3, 8, 8)
    assert report.bytes == json.loads((dataset / fmt / "manifest.json").read_text())["shards"][0][
        "bytes"
    ] + sum(s["bytes"] for s in json.loads((dataset / fmt / "manifest.json").read_text())["shards"][1:])


def test_manifest_file_url_verifies_like_its_directory(dataset: Path) -> None:
    whole = verify_dataset(str(dataset / "tar")).to_json()
    direct = verify_dataset(str(dataset / "tar" / "manifest.json")).to_json()
    assert direct["ok"] and {**direct, "dataset": None} == {**whole, "dataset": None}


def test_flipped_byte_is_a_hash_mismatch(copy) -> None:
    root = copy()
    path = root / "shard-000001.tar"
    data = bytearray(path.read_bytes())
    entry = parse_idx((root / "shard-000001.idx").read_text(), "s")[0].members[-1]  # a jpg's data
    data[entry[1] + 100] ^= 0x40
    path.write_bytes(bytes(data))
    report = verify_dataset(str(root))
    assert errors(report) == [
        ("HashMismatchError", "shard-000001.tar"),
        ("ChecksumMismatchError", "shard-000001.tar"),
    ]
    damaged = report.problems[1]  # the sample's own checksum names it
    sample = parse_idx((root / "shard-000001.idx").read_text(), "s")[0]
    assert (damaged.key, damaged.offset) == (sample.key, entry[1])
    assert damaged.message.startswith(f"field {entry[0]!r} ({entry[2]} bytes) has crc32 ")


def test_corrupt_jpeg_found_by_decode(copy) -> None:
    root = copy()
    path = root / "shard-000000.tar"
    data = bytearray(path.read_bytes())
    sample = parse_idx((root / "shard-000000.idx").read_text(), "s")[1]
    _, off, size, _ = next(m for m in sample.members if m[0] == "jpg")
    data[off : off + size] = b"\0" * size
    path.write_bytes(bytes(data))
    report = verify_dataset(str(root), decode=True)
    decode = [p for p in report.problems if p.error == "SampleDecodeError"]
    assert [(p.shard, p.key, p.offset) for p in decode] == [("shard-000000.tar", sample.key, off)]
    assert "HashMismatchError" in {p.error for p in report.problems}


def test_truncated_shard(copy) -> None:
    root = copy()
    path = root / "shard-000002.tar"
    path.write_bytes(path.read_bytes()[:1500])
    report = verify_dataset(str(root))
    got = {(p.error, p.shard) for p in report.problems}
    assert ("CorruptShardError", "shard-000002.tar") in got and (
        "HashMismatchError",
        "shard-000002.tar",
    ) in got
    truncated = next(p for p in report.problems if "truncated" in p.message)
    assert truncated.offset is not None and truncated.offset <= 1500
    assert any("manifest says" in p.message and "1500" in p.message for p in report.problems)


def test_missing_shard(copy) -> None:
    root = copy()
    (root / "shard-000001.tar").unlink()
    report = verify_dataset(str(root))
    assert errors(report) == [("MissingShardError", "shard-000001.tar")]
    assert report.samples == 5


def test_bad_idx_entry_and_missing_idx(copy) -> None:
    root = copy()
    idx = (root / "shard-000000.idx").read_text().splitlines()
    fields = idx[2].split()
    fields[1] = str(int(fields[1]) + 512)  # first member of the 2nd sample: wrong offset
    idx[2] = " ".join(fields)
    (root / "shard-000000.idx").write_text("\n".join(idx) + "\n")
    (root / "shard-000002.idx").unlink()
    report = verify_dataset(str(root))
    assert errors(report) == [
        ("IndexMismatchError", "shard-000000.tar"),
        ("IndexMismatchError", "shard-000002.tar"),
    ]
    assert report.problems[0].offset == int(fields[1]) and report.problems[0].key == fields[3].split(".")[0]
    assert "does not match the tar headers" in report.problems[0].message
    assert "missing index" in report.problems[1].message


def test_sample_count_disagreeing_with_manifest(copy) -> None:
    root = copy()
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["shards"][0]["samples"] = 4
    (root / "manifest.json").write_text(json.dumps(manifest))
    messages = [p.message for p in verify_dataset(str(root)).problems]
    assert messages == ["manifest says 4 samples, the tar holds 3", ".idx lists 3 samples, manifest says 4"]


def test_unknown_manifest_version(copy) -> None:
    root = copy()
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["version"] = 99
    (root / "manifest.json").write_text(json.dumps(manifest))
    report = verify_dataset(str(root))
    assert (
        errors(report) == [("ManifestError", None)]
        and "unknown manifest format version 99" in report.problems[0].message
    )


def test_arrow_truncated_and_count(copy) -> None:
    root = copy("arrow")
    path = root / "shard-000001.arrow"
    path.write_bytes(path.read_bytes()[:-100])
    report = verify_dataset(str(root))
    got = [(p.error, p.shard) for p in report.problems]
    assert ("CorruptShardError", "shard-000001.arrow") in got and (
        "HashMismatchError",
        "shard-000001.arrow",
    ) in got


def test_no_manifest_points_to_stallfree_index(tmp_path: Path) -> None:
    report = verify_dataset(str(tmp_path))
    assert errors(report) == [("MissingShardError", "manifest.json")]
    assert "stallfree index" in report.problems[0].message


# -- a sample key two shards share ---------------------------------------------------------------


def write(root: Path, fmt: str, keys: list[str], per_shard: int) -> Path:
    from stallfree.shards.writer import ShardWriter

    with ShardWriter(str(root), format=fmt, max_samples=per_shard) as w:
        for i, key in enumerate(keys):
            w.write({"__key__": key, "txt": f"text {i}", "cls": i})
    return root


def header_offset(root: Path, shard: str, key: str) -> int:
    idx = parse_idx((root / shard.replace(".tar", ".idx")).read_text(), shard)
    return next(s for s in idx if s.key == key).members[0][1] - 512


def dup(report) -> list[tuple[str, str | None, str | None, int | None]]:
    return [(p.message, p.shard, p.key, p.offset) for p in report.problems if p.error == "DuplicateKeyError"]


def test_key_in_two_tar_shards(tmp_path: Path) -> None:
    root = write(tmp_path / "ds", "tar", ["a", "b", "c", "d", "b", "e", "f", "g", "a"], per_shard=3)
    report = verify_dataset(str(root))
    assert (report.shards, report.samples) == (3, 9)
    assert errors(report) == [
        ("DuplicateKeyError", "shard-000001.tar"),
        ("DuplicateKeyError", "shard-000002.tar"),
    ]
    assert dup(report) == [
        (
            "duplicate sample key across shards: also in shard-000000.tar",
            "shard-000001.tar",
            "b",
            header_offset(root, "shard-000001.tar", "b"),
        ),
        (
            "duplicate sample key across shards: also in shard-000000.tar",
            "shard-000002.tar",
            "a",
            header_offset(root, "shard-000002.tar", "a"),
        ),
    ]
    assert header_offset(root, "shard-000001.tar", "b") > 0  # not the shard's first sample


def test_key_in_two_arrow_shards(tmp_path: Path) -> None:
    root = write(tmp_path / "ds", "arrow", ["a", "b", "c", "d", "e", "f", "x", "c"], per_shard=3)
    report = verify_dataset(str(root))
    assert dup(report) == [
        ("duplicate sample key across shards: also in shard-000000.arrow", "shard-000002.arrow", "c", None)
    ]
    assert errors(report) == [("DuplicateKeyError", "shard-000002.arrow")]


def test_distinct_keys_across_shards_are_fine(tmp_path: Path) -> None:
    for fmt in ("tar", "arrow"):
        report = verify_dataset(str(write(tmp_path / fmt, fmt, [f"k{i}" for i in range(7)], per_shard=2)))
        assert report.ok, report.problems


def test_many_shared_keys_are_listed_up_to_ten_then_counted(tmp_path: Path) -> None:
    keys = [f"k{i:02d}" for i in range(12)]
    root = write(tmp_path / "ds", "tar", keys + keys, per_shard=12)  # the same keys written twice
    report = verify_dataset(str(root))
    assert [(p.shard, p.key) for p in report.problems[:10]] == [("shard-000001.tar", k) for k in keys[:10]]
    assert [(p.error, p.message, p.shard, p.key) for p in report.problems[10:]] == [
        ("DuplicateKeyError", "... and 2 more sample keys also in shard-000000.tar", "shard-000001.tar", None)
    ]


def test_manifest_listing_one_shard_twice(tmp_path: Path) -> None:
    root = write(tmp_path / "ds", "tar", ["a", "b", "c", "d"], per_shard=2)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["shards"].append(manifest["shards"][0])
    (root / "manifest.json").write_text(json.dumps(manifest))
    report = verify_dataset(str(root))
    assert [(p.message, p.shard, p.key) for p in report.problems] == [
        (
            "duplicate sample key across shards: also in shard-000000.tar"
            " (the manifest lists that file twice)",
            "shard-000000.tar",
            key,
        )
        for key in ("a", "b")
    ]


def test_cli_verify_reports_a_key_two_shards_share(tmp_path: Path, capsys) -> None:
    from stallfree.cli import main

    root = write(tmp_path / "ds", "tar", ["a", "b", "c", "a"], per_shard=2)
    assert main(["verify", str(root), "--json", "--no-progress"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["problems"] == [
        {
            "error": "DuplicateKeyError",
            "shard": "shard-000001.tar",
            "key": "a",
            "offset": header_offset(root, "shard-000001.tar", "a"),
            "message": "duplicate sample key across shards: also in shard-000000.tar",
        }
    ]


def test_shared_keys_past_ten_name_at_most_five_shards(tmp_path: Path) -> None:
    from stallfree.shards.writer import ShardWriter

    keys = [f"k{i:02d}" for i in range(16)]
    root, extra = tmp_path / "ds", tmp_path / "extra"
    with ShardWriter(str(extra), max_samples=16, start_index=16) as w:  # all 16 keys in shard 16
        for key in keys:
            w.write({"__key__": key, "txt": key})
    last = json.loads((extra / "manifest.json").read_text())["shards"]
    write(root, "tar", keys, per_shard=1)  # shards 0..15: one key each
    for name in ("shard-000016.tar", "shard-000016.idx", "shard-000016.sums"):  # then shard 16 beside them
        shutil.copy(extra / name, root / name)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["shards"] += last
    (root / "manifest.json").write_text(json.dumps(manifest))
    report = verify_dataset(str(root))
    assert [(p.shard, p.key, p.message) for p in report.problems[:10]] == [
        ("shard-000016.tar", k, f"duplicate sample key across shards: also in shard-0000{i:02d}.tar")
        for i, k in enumerate(keys[:10])
    ]
    assert [(p.shard, p.key, p.message) for p in report.problems[10:]] == [
        (
            "shard-000016.tar",
            None,
            "... and 6 more sample keys also in shard-000010.tar, shard-000011.tar, shard-000012.tar, "
            "shard-000013.tar, shard-000014.tar and 1 more shards",
        )
    ]
    problems = open_dataset(str(root)).verify()
    assert [(type(p).__name__, p.shard, p.key) for p in problems] == [
        ("DuplicateKeyError", "shard-000016.tar", k) for k in keys[:10]
    ] + [("DuplicateKeyError", "shard-000016.tar", None)]


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_dataset_verify_finds_a_key_two_shards_share(tmp_path: Path, fmt: str) -> None:
    """The Python API's ``ShardedDataset.verify`` checks the same."""
    root = write(tmp_path / "ds", fmt, ["a", "b", "c", "d", "b", "e", "f", "g", "a"], per_shard=3)
    ds = open_dataset(str(root))
    assert [s["__key__"] for s in ds] == ["a", "b", "c", "d", "b", "e", "f", "g", "a"]
    problems = ds.verify()
    ext = f".{fmt}"
    offset = (
        (lambda shard, key: header_offset(root, shard, key)) if fmt == "tar" else (lambda shard, key: None)
    )
    assert [(type(p).__name__, p.reason, p.shard, p.key, p.offset) for p in problems] == [
        (
            "DuplicateKeyError",
            f"duplicate sample key across shards: also in shard-000000{ext}",
            f"shard-00000{n}{ext}",
            key,
            offset(f"shard-00000{n}{ext}", key),
        )
        for n, key in ((1, "b"), (2, "a"))
    ]
    clean = write(tmp_path / "clean", fmt, [f"k{i}" for i in range(7)], per_shard=2)
    assert open_dataset(str(clean)).verify() == []


def test_arrow_rows_without_key_collide_by_the_key_the_dataset_gives_them(tmp_path: Path) -> None:
    """A file without ``__key__`` yields ``stem/row`` keys; another shard's real key can equal one."""
    import pyarrow as pa

    root = tmp_path / "ds"
    root.mkdir()
    for name, table in (
        ("a.arrow", pa.table({"txt": ["x", "y"]})),  # keys a/0, a/1
        ("b.arrow", pa.table({"__key__": ["b0", "a/1"], "txt": ["z", "w"]})),
    ):
        with pa.ipc.new_file(str(root / name), table.schema) as w:
            w.write_table(table)
    ds = open_dataset(str(root / "*.arrow"))
    assert [s["__key__"] for s in ds] == ["a/0", "a/1", "b0", "a/1"]
    assert [(p.reason, p.shard, p.key) for p in ds.verify()] == [
        ("duplicate sample key across shards: also in a.arrow", "b.arrow", "a/1")
    ]
    ds.manifest.save(str(root / "manifest.json"))
    report = verify_dataset(str(root))
    assert [(p.error, p.message, p.shard, p.key) for p in report.problems] == [
        ("DuplicateKeyError", "duplicate sample key across shards: also in a.arrow", "b.arrow", "a/1")
    ]


def test_idx_problems_past_ten_end_in_one_count(tmp_path: Path) -> None:
    """An .idx that lists nothing: ten members are named, the rest counted in one line."""
    root = write(tmp_path / "ds", "tar", [f"k{i:02d}" for i in range(6)], per_shard=6)  # 12 members
    (root / "shard-000000.idx").write_text("v1.2 0\n")
    problems = verify_dataset(str(root)).problems
    assert [(p.error, p.key, p.message) for p in problems] == [
        ("IndexMismatchError", None, ".idx lists 0 samples, manifest says 6")
    ] + [
        ("IndexMismatchError", f"k{i // 2:02d}", f"member k{i // 2:02d}.{field} is not in the .idx")
        for i, field in zip(range(10), ["cls", "txt"] * 5, strict=True)
    ] + [("IndexMismatchError", None, "... and 2 more members missing from the .idx")]


def test_shard_cut_inside_a_member_names_it(tmp_path: Path) -> None:
    root = write(tmp_path / "ds", "tar", ["a", "b"], per_shard=2)
    (b,) = [s for s in parse_idx((root / "shard-000000.idx").read_text(), "s") if s.key == "b"]
    field, offset, size, name = b.members[-1]
    tar = root / "shard-000000.tar"
    tar.write_bytes(tar.read_bytes()[: offset + 3])
    walked = [p for p in verify_dataset(str(root)).problems if p.message.startswith("truncated")]
    assert [(p.error, p.shard, p.key, p.offset, p.message) for p in walked] == [
        (
            "CorruptShardError",
            "shard-000000.tar",
            "b",
            offset - 512,  # the member's header, as every tar reader names it
            f"truncated tar: member {name!r} needs {size} bytes, only 3 present",
        )
    ]
