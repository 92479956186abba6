"""MosaicML MDS directories opened in place by ``open_dataset`` (no ``stallfree shard`` first):
locally and over fsspec (``memory://``), by global index and through the loader, byte-equal to
what ``stallfree shard`` then ``open_dataset`` gives. Fixtures: ``write_mds`` of
``test_source_mds.py`` (the published layout, written without ``mosaicml-streaming``)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
import textwrap
from pathlib import Path

import fsspec
import numpy as np
import pytest

from stallfree.errors import CorruptShardError, IndexMismatchError, ShardError
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import SourceError
from stallfree.testing.images import jpeg_bytes
from tests.shards.test_source_mds import COLUMNS, write_mds
from tests.zygote import run_python

N = 23


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    images = jpeg_bytes(N, seed=5, sizes=((24, 16),))
    rng = np.random.default_rng(1)
    return [
        {
            "image": images[i],
            "label": i % 4,
            "caption": f"photo {i} ünïcode",
            "meta": {"i": i},
            "score": float(np.float32(i / 7)),
            "emb": rng.standard_normal((2, 3)).astype(np.float32),
            "flag": i % 2,
        }
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def mds(rows, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mds") / "ds"
    write_mds(root, COLUMNS, rows, per_shard=6, gz_shards=(1,))
    return root


@pytest.fixture(scope="module")
def sharded(mds, tmp_path_factory) -> list[dict]:
    """Every sample of ``stallfree shard`` of the directory, then ``open_dataset`` of its output."""
    out = tmp_path_factory.mktemp("sharded") / "out"
    shard_dataset(str(mds), str(out), max_samples=5)
    ds = open_dataset(str(out))
    return [ds[i] for i in range(len(ds))]


def test_opens_in_place_byte_equal_to_shard_then_open(mds, sharded, rows):
    ds = open_dataset(str(mds))
    assert ds.format == "mds" and len(ds) == N and ds.shard_sizes == [6, 6, 6, 5]
    got = [ds[i] for i in range(N)]
    assert got == sharded  # same keys, same field names, same bytes
    assert got[7]["image"] == rows[7]["image"] and got[7]["__key__"] == "000000007"
    assert got[7]["label"] == b"3" and got[7]["caption"] == "photo 7 ünïcode".encode()
    assert ds[-1] == sharded[-1] and ds.key_of(9) == "000000009"
    assert ds.get_many([20, 3, 8, 3]) == [sharded[20], sharded[3], sharded[8], sharded[3]]
    assert list(ds) == sharded
    assert ds.manifest.fields == sorted(COLUMNS)
    assert ds.verify() == []


def test_the_index_json_url_opens_the_same_dataset(mds, sharded):
    ds = open_dataset(str(mds / "index.json"))
    assert [ds[i] for i in range(N)] == sharded


def test_fingerprint_is_stable_and_follows_content(mds, rows, tmp_path):
    a, b = open_dataset(str(mds)), open_dataset(str(mds))
    assert a.fingerprint == b.fingerprint
    assert pickle.loads(pickle.dumps(a)).fingerprint == a.fingerprint
    copy = tmp_path / "ds"
    write_mds(copy, COLUMNS, rows, per_shard=6, gz_shards=(1,))
    before = open_dataset(str(copy)).fingerprint
    index = json.loads((copy / "index.json").read_text())
    (copy / "index.json").write_text(json.dumps(index) + "\n")  # rewritten, same entries
    assert open_dataset(str(copy)).fingerprint == before
    label = index["shards"][0]["column_names"].index("label")
    index["shards"][0]["column_encodings"][label] = "int64"  # an entry changes (same bytes decode)
    (copy / "index.json").write_text(json.dumps(index))
    changed = open_dataset(str(copy)).fingerprint
    assert changed != before
    data = bytearray((copy / "shard.00003.mds").read_bytes())
    data[-1] ^= 0xFF  # one byte of the last sample, in place: same size
    (copy / "shard.00003.mds").write_bytes(bytes(data))
    assert open_dataset(str(copy)).fingerprint not in (before, changed)


def test_an_index_changed_under_an_open_dataset_is_refused(rows, tmp_path):
    write_mds(tmp_path / "ds", COLUMNS, rows, per_shard=6)
    ds = open_dataset(str(tmp_path / "ds"))
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["shards"][2]["column_encodings"][0] = "str"  # caption stays str; another column changes
    index["shards"][2]["column_encodings"][1] = "bytes"
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    assert ds[0]["__key__"] == "000000000"  # shard 0 opened after the change: its entry is the same
    with pytest.raises(IndexMismatchError, match="index.json changed since the dataset was opened") as info:
        ds[13]
    assert info.value.shard == "shard.00002.mds"


def test_pickled_and_unknown_columns_are_refused_when_opened(rows, tmp_path):
    write_mds(tmp_path / "ds", {"image": "jpeg"}, rows[:2], per_shard=2)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["shards"][0]["column_encodings"] = ["pkl"]
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"column 'image' \(pkl\) holds pickled values") as info:
        open_dataset(str(tmp_path / "ds"))
    assert str(tmp_path / "ds" / "index.json") in str(info.value)


def test_over_fsspec_memory_with_ranged_reads(mds, sharded):
    fs = fsspec.filesystem("memory")
    for name in os.listdir(mds):
        fs.pipe(f"/inplace-mds/{name}", (mds / name).read_bytes())
    try:
        ds = open_dataset("memory://inplace-mds")
        assert ds.format == "mds"
        assert [ds[i] for i in range(N)] == sharded
        assert ds.get_many(list(range(N))[::-1]) == sharded[::-1]
        assert ds.fingerprint == open_dataset("memory://inplace-mds").fingerprint
    finally:
        fs.rm("/inplace-mds", recursive=True)


def test_loader_shuffled_with_two_workers_gives_every_sample_once(mds, sharded):
    """In a subprocess (worker processes; a hang fails the test, not the suite)."""
    code = textwrap.dedent(
        f"""
        import json, stallfree
        from stallfree.shards.open import open_dataset
        ds = open_dataset({str(mds)!r})
        loader = stallfree.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, seed=3,
                                      collate_fn=lambda b: b)
        seen = [(s["__key__"], s["image"].hex(), s["label"].decode()) for batch in loader for s in batch]
        print(json.dumps(seen))
        """
    )
    out = run_python(code, timeout=180)  # torch preloaded (tests/zygote.py)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(map(tuple, seen)) == sorted(
        (s["__key__"], s["image"].hex(), s["label"].decode()) for s in sharded
    )
    assert [k for k, _, _ in seen] != sorted(k for k, _, _ in seen)  # shuffled


def _damaged_gz(rows, root: Path) -> None:
    write_mds(root, {"image": "jpeg", "label": "int"}, rows, per_shard=6, gz_shards=(1,))
    path = root / "shard.00001.mds.gz"
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])  # deflate data damaged mid-file
    path.write_bytes(bytes(data))


def test_a_damaged_gz_shard_is_a_typed_error_naming_the_file(rows, tmp_path):
    _damaged_gz(rows, tmp_path / "ds")
    ds = open_dataset(str(tmp_path / "ds"))
    assert ds[0]["__key__"] == "000000000"  # the other shards read
    with pytest.raises(CorruptShardError, match=r"cannot decompress \(gz\)") as info:
        ds[7]
    assert info.value.shard == "shard.00001.mds.gz"


def test_a_damaged_gz_shard_is_skipped_by_shard_on_error_skip(rows, tmp_path):
    from stallfree.cli import main

    _damaged_gz(rows, tmp_path / "ds")
    with pytest.raises(ShardError, match=r"shard.00001.mds.gz: cannot decompress \(gz\)"):
        shard_dataset(str(tmp_path / "ds"), str(tmp_path / "o1"))
    assert (
        main(["shard", str(tmp_path / "ds"), str(tmp_path / "o2"), "--on-error", "skip", "--no-progress"])
        == 0
    )
    out = open_dataset(str(tmp_path / "o2"))
    assert len(out) == N - 6
    assert [s["source"] for s in out.manifest.skipped] == [str(tmp_path / "ds" / "shard.00001.mds.gz")]
    assert "cannot decompress (gz)" in out.manifest.skipped[0]["error"]


def test_the_loader_skips_a_damaged_gz_shard_under_on_error_skip(rows, tmp_path):
    _damaged_gz(rows, tmp_path / "ds")
    code = textwrap.dedent(
        f"""
        import stallfree
        from stallfree.shards.open import open_dataset
        ds = open_dataset({str(tmp_path / "ds")!r})
        loader = stallfree.DataLoader(ds, batch_size=4, num_workers=1, on_error="skip", max_failures=1.0,
                                      collate_fn=lambda b: b)
        print(sorted(s["__key__"] for batch in loader for s in batch))
        """
    )
    out = run_python(code, timeout=180)  # torch preloaded (tests/zygote.py)
    assert out.returncode == 0, out.stderr[-3000:]
    keys = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child's printed list
    assert keys == [f"{i:09d}" for i in range(N) if not 6 <= i < 12]


def test_a_gz_bomb_is_refused_at_the_recorded_size(rows, tmp_path):
    write_mds(tmp_path / "ds", {"image": "jpeg"}, rows[:2], per_shard=2, gz_shards=(0,))
    path = tmp_path / "ds" / "shard.00000.mds.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw + bytes(50 << 20)))  # decompresses to 50 MiB more than recorded
    ds = open_dataset(str(tmp_path / "ds"))
    with pytest.raises(CorruptShardError, match=rf"decompresses to more than the {len(raw)} bytes"):
        ds[0]


def test_a_truncated_raw_shard_names_file_and_offset(rows, tmp_path):
    write_mds(tmp_path / "ds", {"image": "jpeg", "label": "int"}, rows[:4], per_shard=4)
    path = tmp_path / "ds" / "shard.00000.mds"
    data = path.read_bytes()
    end = struct.unpack_from("<5I", data, 4)
    bad = bytearray(data)
    bad[end[1] : end[1] + 4] = struct.pack("<I", 10**6)  # sample 1's image size runs past its end
    path.write_bytes(bytes(bad))
    ds = open_dataset(str(tmp_path / "ds"))
    assert ds[0]["__key__"] == "000000000"
    with pytest.raises(
        CorruptShardError, match="sample 1: column 'image' runs past the sample's end"
    ) as info:
        ds[1]
    assert (info.value.shard, info.value.offset) == ("shard.00000.mds", end[1])


def test_compressed_shards_decompress_once_when_read_not_for_keys(mds, monkeypatch):
    from stallfree.shards.inplace import base as inplace
    from stallfree.shards.sources import offsets as source_offsets

    calls = []
    real = source_offsets.DECOMPRESSORS["gz"]
    monkeypatch.setitem(source_offsets.DECOMPRESSORS, "gz", lambda: calls.append(1) or real())
    ds = open_dataset(str(mds))
    assert [ds.key_of(i) for i in range(6, 12)] == [f"{i:09d}" for i in range(6, 12)]
    assert calls == []  # shard 1 (gz) opened for its keys, not decompressed
    assert [ds[i]["__key__"] for i in (9, 6, 11, 7)] == ["000000009", "000000006", "000000011", "000000007"]
    assert len(calls) == 1  # then once for all its samples (the process's LRU keeps it)
    inplace.DECOMPRESSED.drop(ds._readers[1]._token)  # evicted: decompressed again when read
    assert ds[8]["__key__"] == "000000008" and len(calls) == 2


def test_a_damaged_gz_shard_is_one_problem_in_verify(rows, tmp_path):
    _damaged_gz(rows, tmp_path / "ds")
    problems = open_dataset(str(tmp_path / "ds")).verify()
    assert [(type(p).__name__, p.shard) for p in problems] == [("CorruptShardError", "shard.00001.mds.gz")]


def _as_bz2(root: Path, shard: int) -> Path:
    """Shard ``shard`` of a gz fixture recompressed as bz2, its index entry saying so."""
    import bz2

    index = json.loads((root / "index.json").read_text())
    entry = index["shards"][shard]
    gz = root / entry["zip_data"]["basename"]
    packed = bz2.compress(gzip.decompress(gz.read_bytes()))
    gz.unlink()
    name = entry["zip_data"]["basename"].replace(".gz", ".bz2")
    (root / name).write_bytes(packed)
    entry.update(compression="bz2", zip_data={"basename": name, "bytes": len(packed), "hashes": {}})
    (root / "index.json").write_text(json.dumps(index))
    return root / name


def test_bz2_shards_read_and_a_damaged_one_is_typed(rows, sharded, tmp_path):
    write_mds(tmp_path / "ds", COLUMNS, rows, per_shard=6, gz_shards=(1,))
    path = _as_bz2(tmp_path / "ds", 1)
    ds = open_dataset(str(tmp_path / "ds"))
    assert [ds[i] for i in range(N)] == sharded
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    path.write_bytes(bytes(data))
    ds = open_dataset(str(tmp_path / "ds"))
    with pytest.raises(CorruptShardError, match=r"bz2") as info:
        ds[7]
    assert info.value.shard == "shard.00001.mds.bz2"


def test_a_codec_we_cannot_undo_is_named_when_opened(rows, tmp_path):
    write_mds(tmp_path / "ds", COLUMNS, rows, per_shard=6, gz_shards=(1,))
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["shards"][1]["compression"] = "zstd:7"
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(
        SourceError, match=r"shard 1: compression 'zstd:7' is not supported \(supported: gz, bz2\)"
    ):
        open_dataset(str(tmp_path / "ds"))


def test_a_remote_mds_directory_shards_through_open_dataset(mds, sharded, tmp_path):
    """``stallfree shard memory://...`` reads the MDS directory in place (no local copy first)."""
    fs = fsspec.filesystem("memory")
    for name in os.listdir(mds):
        fs.pipe(f"/shard-mds/{name}", (mds / name).read_bytes())
    try:
        shard_dataset("memory://shard-mds", str(tmp_path / "out"), max_samples=5)
    finally:
        fs.rm("/shard-mds", recursive=True)
    out = open_dataset(str(tmp_path / "out"))
    assert [out[i] for i in range(len(out))] == sharded


def test_a_shard_with_raw_and_compressed_files_opens_by_either_name(rows, sharded, tmp_path):
    """The index names both files of a compressed shard; the dataset reads the raw one where it is
    present. A staged copy holds only the file chosen where the dataset was opened, and its index
    may have been parsed before that file landed: the shard is found by either name."""
    import shutil

    from stallfree.shards.formats import ShardOpen
    from stallfree.shards.inplace.mds import MDS

    src = tmp_path / "src"
    write_mds(src, COLUMNS, rows, per_shard=6, gz_shards=(1,))
    (src / "shard.00001.mds").write_bytes(gzip.decompress((src / "shard.00001.mds.gz").read_bytes()))
    ds = open_dataset(str(src))
    assert [s.path for s in ds.manifest.shards][:2] == ["shard.00000.mds", "shard.00001.mds"]
    assert [ds[i] for i in range(N)] == sharded
    staged = tmp_path / "staged"
    staged.mkdir()
    for name in ("index.json", "shard.00000.mds"):
        shutil.copy(src / name, staged / name)
    fs = fsspec.filesystem("file")
    first = MDS.open_reader(ShardOpen(fs, str(staged / "shard.00000.mds"), ds.manifest.shards[0]))
    shutil.copy(src / "shard.00001.mds", staged / "shard.00001.mds")  # lands after the index was parsed
    second = MDS.open_reader(ShardOpen(fs, str(staged / "shard.00001.mds"), ds.manifest.shards[1]))
    assert second.file.compression is None
    assert [first.get(0), second.get(2)] == [sharded[0], sharded[8]]
