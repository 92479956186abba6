"""LitData ``optimize()`` directories opened in place by ``open_dataset``: locally, over
``memory://`` and the loopback S3 server, by global index and through the loader (staged
block order over S3), byte-equal to ``stallfree shard`` then ``open_dataset``. Fixtures:
``write_litdata`` of ``test_source_litdata.py`` (the published layout, without ``litdata``)."""

from __future__ import annotations

import json
import os
import pickle
import textwrap
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import SourceError
from stallfree.testing.images import jpeg_bytes
from tests.shards.test_source_litdata import write_litdata
from tests.zygote import run_python

N = 17


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    images = jpeg_bytes(N, seed=6, sizes=((16, 24),))
    return [
        {
            "label": i % 3,
            "image": images[i],
            "name": f"item {i}",
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


@pytest.fixture(scope="module")
def sharded(litdata, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sharded") / "out"
    shard_dataset(str(litdata), str(out), max_samples=4)
    ds = open_dataset(str(out))
    return [ds[i] for i in range(len(ds))]


def test_opens_in_place_byte_equal_to_shard_then_open(litdata, sharded, rows):
    ds = open_dataset(str(litdata))
    assert ds.format == "litdata" and len(ds) == N and ds.shard_sizes == [5, 5, 5, 2]
    got = [ds[i] for i in range(N)]
    assert got == sharded
    s = got[4]
    assert s["__key__"] == "000000004" and s["image"] == rows[4]["image"] and s["name"] == b"item 4"
    assert (s["label"], s["pair.0"], s["pair.1"]) == (b"1", b"2.0", b"1")
    assert ds.manifest.fields == sorted(["label", "image", "name", "mask", "box", "pair.0", "pair.1"])
    assert ds.get_many([16, 0, 5]) == [sharded[16], sharded[0], sharded[5]]
    assert list(ds) == sharded and ds.verify() == []
    assert (
        pickle.loads(pickle.dumps(ds)).fingerprint == ds.fingerprint == open_dataset(str(litdata)).fingerprint
    )


def test_over_fsspec_memory(litdata, sharded):
    fs = fsspec.filesystem("memory")
    for name in os.listdir(litdata):
        fs.pipe(f"/inplace-lit/{name}", (litdata / name).read_bytes())
    try:
        ds = open_dataset("memory://inplace-lit")
        assert ds.format == "litdata" and ds.get_many(list(range(N))) == sharded
    finally:
        fs.rm("/inplace-lit", recursive=True)


def test_pickled_leaves_are_refused(rows, tmp_path):
    write_litdata(tmp_path / "ds", [{"a": b"x"}, {"a": b"y"}], per_chunk=2)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    index["config"]["data_format"] = ["pickle"]
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match="a leaf is pickled; stallfree never unpickles"):
        open_dataset(str(tmp_path / "ds"))


@pytest.mark.slow
def test_over_s3_through_the_loader_shuffled_with_two_workers(litdata, sharded, tmp_path):
    """The loopback S3 server (moto, its own process); the loader in a subprocess with a timeout:
    block order over a remote dataset stages whole chunks, and index.json beside them."""
    from stallfree.testing.s3serve import moto_available, serve_s3

    reason = moto_available()
    if reason is not None:
        pytest.skip(reason)
    with serve_s3() as s3:
        s3.create_bucket("lit")
        fs = s3.filesystem()
        for name in os.listdir(litdata):
            fs.pipe(f"lit/optimized/{name}", (litdata / name).read_bytes())
        code = textwrap.dedent(
            f"""
            import json, stallfree
            from stallfree.shards.open import open_dataset
            ds = open_dataset("s3://lit/optimized", **{s3.storage_options!r})
            assert ds.format == "litdata", ds
            loader = stallfree.DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, seed=5,
                                          staging={str(tmp_path / "staging")!r}, collate_fn=lambda b: b)
            print(json.dumps([[s["__key__"], s["image"].hex(), s["box"].hex()] for b in loader for s in b]))
            """
        )
        out = run_python(code, timeout=240)  # torch preloaded (tests/zygote.py)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(map(tuple, seen)) == sorted(
        (s["__key__"], s["image"].hex(), s["box"].hex()) for s in sharded
    )
    staged = {name for _, _, names in os.walk(tmp_path / "staging") for name in names}
    assert {"index.json", "chunk-0-0.bin"} <= staged  # read from whole staged chunks, index beside them


def test_counts_that_add_up_past_int64_are_refused_naming_the_index(tmp_path):
    """Each chunk_size an integer, their sum past 2**63 - 1: ``open_dataset`` succeeded and
    ``len()`` of it was an ``OverflowError`` naming nothing (a fuzzed index.json)."""
    write_litdata(tmp_path / "ds", [{"a": b"x"}, {"a": b"y"}], per_chunk=1)
    index = json.loads((tmp_path / "ds" / "index.json").read_text())
    for chunk in index["chunks"]:
        chunk["chunk_size"] = 2**62
    (tmp_path / "ds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"index\.json: its files hold 9223372036854775808 samples in all"):
        open_dataset(str(tmp_path / "ds"))
