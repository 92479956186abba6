"""A URL as a ``stallfree shard`` source: whatever ``open_dataset`` reads remotely (a Hugging Face
``save_to_disk`` directory, a Parquet export, our own shards) shards without copying it down."""

from __future__ import annotations

import tarfile
from pathlib import Path

import fsspec
import pytest

from stallfree.cli import main
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import SourceError, open_source
from stallfree.testing.images import jpeg_bytes

datasets = pytest.importorskip("datasets")

N = 14
NAMES = ["ant", "bee"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    images = jpeg_bytes(N, seed=2, sizes=((32, 24),))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    hf = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "label": [i % 2 for i in range(N)]},
        features=features,
    )
    root = tmp_path_factory.mktemp("hfurl")
    hf.save_to_disk(str(root / "disk"), max_shard_size="10KB")
    hf.to_parquet(str(root / "export" / "train-00000-of-00001.parquet"), batch_size=5)
    return root, images


def _rows(root: Path) -> dict[str, dict[str, bytes]]:
    rows: dict[str, dict[str, bytes]] = {}
    for path in sorted(root.glob("*.tar")):
        with tarfile.open(path) as tf:
            for m in tf:
                key, _, field = m.name.partition(".")
                rows.setdefault(key, {})[field] = tf.extractfile(m).read()
    return rows


def test_remote_save_to_disk_dir_and_parquet_shard_as_rows(hf_dirs, tmp_path):
    root, images = hf_dirs
    fs = fsspec.filesystem("memory")
    fs.put(str(root / "disk"), "/hfurl/disk", recursive=True)
    fs.put(str(root / "export"), "/hfurl/export", recursive=True)
    try:
        for n, url in enumerate(("memory://hfurl/disk", "memory://hfurl/export/*.parquet")):
            source = open_source(url)
            assert source.kind == "dataset" and source.classes == NAMES
            summary = shard_dataset(source, str(tmp_path / f"o{n}"), max_samples=4)
            assert summary.manifest.classes == NAMES and summary.manifest.extra["class_field"] == "label"
            rows = _rows(tmp_path / f"o{n}")
            assert sorted(r["image"] for r in rows.values()) == sorted(images), url
            assert sorted(int(r["label"]) for r in rows.values()) == sorted(i % 2 for i in range(N))
        with pytest.raises(SourceError, match="the kind 'parquet' does not apply"):
            open_source("memory://hfurl/export/*.parquet", "parquet")
    finally:
        fs.rm("/hfurl", recursive=True)


def test_cli_shards_from_s3_with_source_options(hf_dirs, tmp_path):
    from stallfree.testing.s3serve import moto_available, serve_s3

    reason = moto_available()
    if reason:
        pytest.skip(reason)
    root, images = hf_dirs
    with serve_s3() as s3:
        s3.create_bucket("hf-src")
        s3.filesystem().put(str(root / "disk"), "hf-src/disk", recursive=True)
        opts = [arg for k, v in s3.storage_options.items() for arg in ("--source-option", f"{k}={_json(v)}")]
        out = tmp_path / "out"
        assert (
            main(["shard", "s3://hf-src/disk", str(out), "--max-samples", "5", "--no-progress", *opts]) == 0
        )
    rows = _rows(out)
    assert sorted(r["image"] for r in rows.values()) == sorted(images)


def _json(value) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)


def test_remote_path_only_media_read_inside_the_dataset(tmp_path):
    """open_dataset over a non-local filesystem reads a path-only Image() cell with the checked
    remote read, relative to the table's directory, and refuses one that leaves it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stallfree.errors import CorruptShardError
    from stallfree.shards.open import open_dataset

    image = jpeg_bytes(1, seed=3, sizes=((32, 24),))[0]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    table = pa.table(
        {
            "image": [{"bytes": None, "path": "imgs/0.jpg"}, {"bytes": None, "path": "../x.jpg"}],
            "label": [0, 1],
        },
        schema=features.arrow_schema,
    )
    pq.write_table(table, tmp_path / "data.parquet")
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "data.parquet"), "/pathonly/ds/data.parquet")
    fs.pipe("/pathonly/ds/imgs/0.jpg", image)
    fs.pipe("/pathonly/x.jpg", b"outside")
    try:
        ds = open_dataset("memory://pathonly/ds/data.parquet")
        assert ds[0]["image"] == image and ds.manifest.classes == NAMES
        with pytest.raises(CorruptShardError, match="points outside the dataset"):
            ds[1]
    finally:
        fs.rm("/pathonly", recursive=True)
