"""LitData ``optimize()`` datasets as a ``stallfree shard`` source.

``litdata`` would pull a different torch into the test environment, so the fixtures are written
here from the format's published layout: ``index.json`` (``chunks`` + ``config`` with
``data_format`` and a ``data_spec`` made by torch's own pytree ``treespec_dumps``), chunk files of
a uint32 count, uint32 offsets, then samples (one uint32 size per leaf, then the leaves).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten, treespec_dumps

from stallfree.cli import main
from stallfree.shards.open import open_dataset
from stallfree.shards.sources.litdata import leaf_names
from stallfree.shards.sources.registry import SourceError, open_source
from stallfree.testing.images import jpeg_bytes

NUMPY_CODES = {"int8": 0, "int16": 1, "int32": 2, "int64": 3, "uint8": 4, "float32": 9, "float64": 10}
TENSOR_CODES = {torch.float32: 0, torch.float64: 2, torch.uint8: 11, torch.int32: 15, torch.int64: 17}


def _leaf(value) -> tuple[str, bytes]:
    """(serializer name, bytes) for one leaf, as LitData's serializers lay them out."""
    if isinstance(value, bytes) and value[:2] == b"\xff\xd8":
        return "jpeg", value
    if isinstance(value, bytes):
        return "bytes", value
    if isinstance(value, bool):
        return "bool", np.bool_(value).tobytes()
    if isinstance(value, int):
        return "int", np.int64(value).tobytes()
    if isinstance(value, float):
        return "float", np.float64(value).tobytes()
    if isinstance(value, str):
        return "str", value.encode()
    if isinstance(value, np.ndarray):
        head = np.array([NUMPY_CODES[value.dtype.name], value.ndim, *value.shape], np.uint32).tobytes()
        return "numpy", head + value.tobytes()
    if isinstance(value, torch.Tensor):
        head = np.array([TENSOR_CODES[value.dtype], value.ndim, *value.shape], np.uint32).tobytes()
        return "tensor", head + value.numpy().tobytes()
    raise AssertionError(type(value))


def write_litdata(root: Path, samples: list, per_chunk: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    chunks, data_format, spec = [], None, None
    for c, start in enumerate(range(0, len(samples), per_chunk)):
        encoded = []
        for sample in samples[start : start + per_chunk]:
            leaves, spec = tree_flatten(sample)
            parts = [_leaf(v) for v in leaves]
            data_format = data_format or [name for name, _ in parts]
            sizes = np.array([len(b) for _, b in parts], np.uint32).tobytes()
            encoded.append(sizes + b"".join(b for _, b in parts))
        offsets = np.array([0] + [len(e) for e in encoded]).cumsum().astype(np.uint32)
        offsets += 4 + 4 * (len(encoded) + 1)
        data = np.uint32(len(encoded)).tobytes() + offsets.tobytes() + b"".join(encoded)
        name = f"chunk-0-{c}.bin"
        (root / name).write_bytes(data)
        chunks.append({"chunk_bytes": len(data), "chunk_size": len(encoded), "dim": None, "filename": name})
    config = {"chunk_bytes": 1 << 20, "chunk_size": None, "compression": None, "data_format": data_format,
              "data_spec": treespec_dumps(spec), "encryption": None, "item_loader": "PyTreeLoader"}  # fmt: skip
    (root / "index.json").write_text(json.dumps({"chunks": chunks, "config": config}, sort_keys=True))


N = 17


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    images = jpeg_bytes(N, seed=4, sizes=((32, 40),))
    # keys deliberately not sorted: leaves follow the dict's own order, as torch's pytree does
    return [
        {
            "label": i % 3,
            "image": images[i],
            "name": f"item {i}",
            "raw": bytes([i]) * (i + 1),
            "mask": np.arange(i + 1, dtype=np.uint8),
            "box": torch.tensor([i, i + 1.5, 2.0, 3.0], dtype=torch.float32),
            "pair": (i * 0.5, i % 2 == 0),
        }
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def litdata(rows, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lit") / "optimized"
    write_litdata(root, rows, per_chunk=5)
    return root


def test_every_leaf_read_back(litdata, rows):
    source = open_source(str(litdata))
    assert source.kind == "litdata"
    assert source.fields == ["label", "image", "name", "raw", "mask", "box", "pair.0", "pair.1"]
    got = list(source.read_many(source.items()))
    assert len(got) == N
    for i, (s, row) in enumerate(zip(got, rows, strict=True)):
        assert s["__key__"] == f"{i:09d}"
        assert s["image"] == row["image"] and s["raw"] == row["raw"]  # bytes exactly
        assert s["label"] == row["label"] and s["name"] == row["name"]
        np.testing.assert_array_equal(s["mask"], row["mask"])
        np.testing.assert_array_equal(s["box"], row["box"].numpy())
        assert s["box"].dtype == np.float32
        assert (s["pair.0"], s["pair.1"]) == row["pair"]


def test_litdata_to_dataloader_every_row_once(litdata, rows, tmp_path):
    """Done-when: LitData -> stallfree shard -> stallfree.DataLoader + ImageDecode."""
    from stallfree.gpu_decode.select import ImageDecode
    from stallfree.loader.dataloader import DataLoader

    out = tmp_path / "shards"
    assert main(["shard", str(litdata), str(out), "--max-samples", "6", "--no-progress"]) == 0
    with tarfile.open(out / "shard-000000.tar") as tf:
        assert tf.extractfile("000000000.image").read() == rows[0]["image"]
    ds = open_dataset(str(out))
    dec = ImageDecode(train=False, size=16, backend="cpu", num_threads=1, label_field="label")
    seen: dict[str, int] = {}
    for batch in DataLoader(ds, batch_size=5, shuffle=True, seed=2, decode=dec):
        for key, label in zip(batch["__key__"], batch["label"].tolist(), strict=True):
            assert key not in seen
            seen[key] = label
    assert seen == {f"{i:09d}": r["label"] for i, r in enumerate(rows)}


def test_leaf_names_of_torch_specs():
    for sample, names in (
        ({"b": 1, "a": {"y": 2, "x": 3}}, ["b", "a.y", "a.x"]),
        ((1, "s", b"x"), ["0", "1", "2"]),
        ([1, 2], ["0", "1"]),
    ):
        leaves, spec = tree_flatten(sample)
        assert leaf_names(treespec_dumps(spec), len(leaves), "index.json") == names
    assert leaf_names(None, 1, "index.json") == ["data"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data_format": ["pickle"]}, "a leaf is pickled; stallfree never unpickles"),
        ({"compression": "zstd"}, "compression 'zstd' is not supported"),
        ({"item_loader": "TokensLoader"}, "only PyTreeLoader datasets are read"),
        ({"encryption": {"level": "chunk"}}, "the dataset is encrypted"),
    ],
)
def test_unreadable_configs_are_refused_by_name(rows, tmp_path, change, message):
    write_litdata(tmp_path / "ds", [{"x": 1}], per_chunk=1)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["config"].update(change)
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=message):
        open_source(str(tmp_path / "ds"))
