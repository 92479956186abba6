"""MDS and LitData datasets written by their own libraries (``mosaicml-streaming``'s ``MDSWriter``,
``litdata.optimize``), opened in place: each sample's fields are what was written, and every
sample is byte-equal to ``stallfree shard`` of the directory then ``open_dataset``.

Both libraries pull a torch of their own, so they live in ``.venv-formats``
(``scripts/formats_env.sh``, run by ``scripts/setup.sh``); the writers run there in a subprocess
(``formats_writers_child.py``), with a timeout. Skipped, saying so, where that venv is missing."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from tests.shards.formats_writers_child import N, lit_lists, lit_row, mds_row

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-formats" / "bin" / "python"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    if not PYTHON.exists():
        pytest.skip("no .venv-formats with mosaicml-streaming and litdata: run scripts/formats_env.sh")
    root = tmp_path_factory.mktemp("written")
    child = Path(__file__).with_name("formats_writers_child.py")
    out = subprocess.run(
        [str(PYTHON), str(child), str(root)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return root


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _byte_equal_to_shard_then_open(root: Path, tmp_path: Path) -> list[dict]:
    ds = open_dataset(str(root))
    shard_dataset(str(root), str(tmp_path / "out"), max_samples=7)
    ref = open_dataset(str(tmp_path / "out"))
    got = [ds[i] for i in range(len(ds))]
    assert got == [ref[i] for i in range(len(ref))] and len(got) == N
    return got


@pytest.mark.parametrize("name", ["mds-gz", "mds-raw"])
def test_mds_written_by_mosaicml_streaming(written, name, tmp_path):
    index = json.loads((written / name / "index.json").read_text())
    assert len(index["shards"]) > 1
    assert {s["compression"] for s in index["shards"]} == ({"gz"} if name == "mds-gz" else {None})
    ds = open_dataset(str(written / name))
    assert ds.format == "mds"
    got = _byte_equal_to_shard_then_open(written / name, tmp_path)
    for i, sample in enumerate(got):
        row = mds_row(i)
        assert sample["__key__"] == f"{i:09d}" and sample["image"] == row["image"]
        assert (sample["label"], sample["flag"]) == (str(i).encode(), str(i % 2).encode())
        assert sample["caption"] == row["caption"].encode()
        assert json.loads(sample["meta"]) == row["meta"]
        assert float(sample["score"]) == pytest.approx(row["score"], rel=1e-6)
        np.testing.assert_array_equal(_npy(sample["emb"]), row["emb"])
        arr = _npy(sample["arr"])
        assert arr.dtype == np.int16 and arr.tolist() == row["arr"].tolist()


def test_litdata_written_by_optimize(written, tmp_path):
    ds = open_dataset(str(written / "lit"))
    assert ds.format == "litdata" and len(ds.shard_sizes) == 4
    got = _byte_equal_to_shard_then_open(written / "lit", tmp_path)
    for i, sample in enumerate(got):
        row = lit_row(i)
        assert sample["__key__"] == f"{i:09d}" and sample["image"] == row["image"]
        assert (sample["index"], sample["name"]) == (str(i).encode(), row["name"].encode())
        assert (float(sample["pair.0"]), sample["pair.1"]) == (
            row["pair"][0],
            b"1" if row["pair"][1] else b"0",
        )
        assert _npy(sample["arr"]).tolist() == row["arr"].tolist()
        # lists are litdata `json` leaves (its binary nested form): JSON text here
        for field, value in lit_lists(i).items():
            assert json.loads(sample[field]) == value, (i, field, sample[field])
