"""MosaicML MDS datasets as a ``stallfree shard`` source.

``mosaicml-streaming`` would pull a different torch into the test environment, so the fixtures are
written here from the format's published layout (``index.json`` v2; a shard is a uint32 count,
uint32 offsets, the JSON config, then samples: one uint32 size per variable-size column, then
the columns in sorted-name order): ``write_mds`` below, independent of our reader's code.
"""

from __future__ import annotations

import gzip
import json
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest

from stallfree.cli import main
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import SourceError, SourceReadError, open_source
from stallfree.testing.images import jpeg_bytes

FIXED = {"int": 8, "uint8": 1, "int32": 4, "float32": 4, "float64": 8}


def _encode(encoding: str, value) -> bytes:
    if encoding in ("bytes", "jpeg", "png"):
        return value
    if encoding in ("str", "json"):
        return (json.dumps(value) if encoding == "json" else value).encode()
    if encoding == "int":
        return np.int64(value).tobytes()
    if encoding in FIXED:
        return np.dtype(encoding).type(value).tobytes()
    if encoding == "ndarray":  # dynamic dtype and shape: dtype code, ndim<<2|shape dtype, dims
        code = {"uint8": 8, "int16": 17, "float32": 34, "int64": 65}[value.dtype.name]
        return (
            bytes([code, (value.ndim << 2) | 1])
            + np.array(value.shape, np.uint16).tobytes()
            + value.tobytes()
        )
    raise AssertionError(encoding)


def write_mds(root: Path, columns: dict[str, str], samples: list[dict], per_shard: int, gz_shards=()) -> None:
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(columns)
    encodings = [columns[n] for n in names]
    sizes = [FIXED.get(e) for e in encodings]
    shards = []
    for s, start in enumerate(range(0, len(samples), per_shard)):
        chunk = samples[start : start + per_shard]
        compression = "gz" if s in gz_shards else None
        config = {"column_encodings": encodings, "column_names": names, "column_sizes": sizes,
                  "compression": compression, "format": "mds", "hashes": [], "size_limit": 1 << 26,
                  "version": 2}  # fmt: skip
        config_bytes = json.dumps(config, sort_keys=True).encode()
        encoded = []
        for sample in chunk:
            cells = [_encode(e, sample[n]) for n, e in zip(names, encodings, strict=True)]
            head = np.array(
                [len(c) for c, z in zip(cells, sizes, strict=True) if z is None], np.uint32
            ).tobytes()
            encoded.append(head + b"".join(cells))
        offsets = np.array([0] + [len(e) for e in encoded]).cumsum().astype(np.uint32)
        offsets += 4 + 4 * (len(chunk) + 1) + len(config_bytes)
        data = np.uint32(len(chunk)).tobytes() + offsets.tobytes() + config_bytes + b"".join(encoded)
        raw = {"basename": f"shard.{s:05d}.mds", "bytes": len(data), "hashes": {}}
        zipped = None
        if compression:
            packed = gzip.compress(data)
            zipped = {"basename": f"shard.{s:05d}.mds.gz", "bytes": len(packed), "hashes": {}}
            (root / zipped["basename"]).write_bytes(packed)
        else:
            (root / raw["basename"]).write_bytes(data)
        shards.append({**config, "samples": len(chunk), "raw_data": raw, "zip_data": zipped})
    (root / "index.json").write_text(json.dumps({"version": 2, "shards": shards}, sort_keys=True))


N = 23


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    images = jpeg_bytes(N, seed=9, sizes=((40, 32),))
    rng = np.random.default_rng(0)
    return [
        {
            "image": images[i],
            "label": i % 4,
            "caption": f"photo {i} ünïcode",
            "meta": {"i": i, "tags": ["a", "b"][: i % 3]},
            "score": float(np.float32(i / 7)),
            "emb": rng.standard_normal((2, 3)).astype(np.float32),
            "flag": i % 2,
        }
        for i in range(N)
    ]


COLUMNS = {"image": "jpeg", "label": "int", "caption": "str", "meta": "json", "score": "float32",
           "emb": "ndarray", "flag": "uint8"}  # fmt: skip


@pytest.fixture(scope="module")
def mds(rows, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mds") / "ds"
    write_mds(root, COLUMNS, rows, per_shard=6, gz_shards=(1,))
    return root


def test_every_sample_and_cell_read_back(mds, rows):
    source = open_source(str(mds))
    assert source.kind == "mds"
    items = source.items()
    assert len(items) == N
    got = list(source.read_many(items))
    for i, (sample, row) in enumerate(zip(got, rows, strict=True)):
        assert sample["__key__"] == f"{i:09d}"
        assert sample["image"] == row["image"]  # the JPEG bytes, exactly
        assert sample["label"] == row["label"] and type(sample["label"]) is int
        assert sample["caption"] == row["caption"]
        assert json.loads(sample["meta"]) == row["meta"] and sample["meta"] == json.dumps(row["meta"])
        assert sample["score"] == row["score"] and sample["flag"] == row["flag"]
        np.testing.assert_array_equal(sample["emb"], row["emb"])
        assert sample["emb"].dtype == np.float32


def test_mds_to_dataloader_every_row_once(mds, rows, tmp_path):
    """Done-when: MDS -> stallfree shard -> stallfree.DataLoader + ImageDecode."""
    from stallfree.gpu_decode.select import ImageDecode
    from stallfree.loader.dataloader import DataLoader

    out = tmp_path / "shards"
    assert main(["shard", str(mds), str(out), "--max-samples", "5", "--no-progress"]) == 0
    with tarfile.open(out / "shard-000000.tar") as tf:
        first = tf.getmembers()[0]
        assert tf.extractfile(tf.getmember("000000000.image")).read() == rows[0]["image"]
    assert first.name.startswith("000000000.")
    ds = open_dataset(str(out))
    dec = ImageDecode(train=True, size=16, backend="cpu", num_threads=1, label_field="label")
    seen: dict[str, int] = {}
    for batch in DataLoader(ds, batch_size=4, shuffle=True, seed=1, decode=dec):
        for key, label in zip(batch["__key__"], batch["label"].tolist(), strict=True):
            assert key not in seen
            seen[key] = label
    assert seen == {f"{i:09d}": r["label"] for i, r in enumerate(rows)}


def test_arrow_output_byte_equal(rows, tmp_path):
    columns = {k: v for k, v in COLUMNS.items() if k != "emb"}  # Arrow shards hold 1-D arrays only
    write_mds(tmp_path / "ds", columns, rows, per_shard=9)
    shard_dataset(str(tmp_path / "ds"), str(tmp_path / "a"), format="arrow", max_samples=10)
    ds = open_dataset(str(tmp_path / "a"))
    assert [ds[i]["image"] for i in range(N)] == [r["image"] for r in rows]
    assert [ds[i]["caption"] for i in range(N)] == [r["caption"] for r in rows]


def test_pickled_columns_are_refused(rows, tmp_path):
    write_mds(tmp_path / "ds", {"image": "jpeg"}, rows[:2], per_shard=2)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["shards"][0]["column_encodings"] = ["pkl"]
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"column 'image' \(pkl\) holds pickled values"):
        open_source(str(tmp_path / "ds"))


def test_shard_files_outside_the_dataset_are_refused(rows, tmp_path):
    write_mds(tmp_path / "ds", {"image": "jpeg"}, rows[:2], per_shard=2)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["shards"][0]["raw_data"]["basename"] = "../elsewhere.mds"
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"shard file '../elsewhere.mds' is outside the dataset"):
        open_source(str(tmp_path / "ds"))


def test_truncated_shard_names_file_sample_and_offset(rows, tmp_path):
    write_mds(tmp_path / "ds", {"image": "jpeg", "label": "int"}, rows[:4], per_shard=4)
    path = tmp_path / "ds" / "shard.00000.mds"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(
        SourceReadError, match=r"shard.00000.mds: sample offsets .* fall outside the file"
    ) as info:
        open_source(str(tmp_path / "ds")).items()
    assert info.value.offset == 4
    # A bad cell in one sample: skip drops that sample only, and lists it.
    path.write_bytes(data)
    end = struct.unpack_from("<5I", data, 4)
    bad = bytearray(data)
    bad[end[1] : end[1] + 4] = struct.pack("<I", 10**6)  # sample 1's image size runs past its end
    path.write_bytes(bytes(bad))
    summary = shard_dataset(
        open_source(str(tmp_path / "ds"), on_error="skip"), str(tmp_path / "o"), on_error="skip"
    )
    assert summary.samples == 3
    assert "sample 1: column 'image' runs past the sample's end" in summary.skipped[0]["error"]


def test_same_bytes_for_any_worker_count(mds, tmp_path):
    for workers in (1, 3):
        shard_dataset(str(mds), str(tmp_path / f"w{workers}"), max_samples=4, workers=workers)
    one, three = ({p.name: p.read_bytes() for p in (tmp_path / w).iterdir()} for w in ("w1", "w3"))
    assert len(one) > 3 and one == three


def test_an_index_json_of_another_kind_is_just_a_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "index.json").write_text("not json")
    (tmp_path / "d" / "a.txt").write_text("x")
    assert open_source(str(tmp_path / "d")).kind == "files"
    with pytest.raises(SourceError, match=r"cannot read the MDS index .*index.json"):
        open_source(str(tmp_path / "d"), "mds")


def test_compressed_shards_decompressed_once_per_read_in_any_order(rows, tmp_path, monkeypatch):
    import random

    from stallfree.shards.sources import offsets as source_offsets

    write_mds(
        tmp_path / "ds", {"image": "jpeg", "label": "int"}, rows, per_shard=5, gz_shards=(0, 1, 2, 3, 4)
    )
    calls = []
    real = source_offsets.DECOMPRESSORS["gz"]
    monkeypatch.setitem(source_offsets.DECOMPRESSORS, "gz", lambda: calls.append(1) or real())
    source = open_source(str(tmp_path / "ds"))
    items = source.items()
    calls.clear()
    shuffled = random.Random(1).sample(items, len(items))
    got = list(source.read_many(shuffled))
    assert [s["image"] for s in got] == [rows[it.ref[4]]["image"] for it in shuffled]
    assert len(calls) == 5  # each of the 5 files once, not once per sample
