"""Interoperability: our shards read by webdataset, DALI and plain pyarrow, sample for sample and
byte for byte; shards written by webdataset open with open_dataset."""

import os

import numpy as np
import pyarrow.ipc as ipc
import pytest

from stallfree.shards.manifest.model import Manifest
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.images import jpeg_bytes

FIELDS = ("cls", "jpg", "txt")


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory):
    """30 real JPEGs with labels and captions, in 3 tar shards written by ShardWriter."""
    root = tmp_path_factory.mktemp("compat")
    images = jpeg_bytes(30, seed=3, sizes=((160, 120), (96, 128)))
    samples = [
        {"__key__": f"img{i:04d}", "jpg": img, "cls": i % 4, "txt": f"a photo, number {i}"}
        for i, img in enumerate(images)
    ]
    with ShardWriter(str(root), max_samples=10) as w:
        for s in samples:
            w.write(s)
    expected = [
        {"__key__": s["__key__"], "jpg": s["jpg"], "cls": str(s["cls"]).encode(), "txt": s["txt"].encode()}
        for s in samples
    ]
    return root, Manifest.load(str(root)), expected


def test_webdataset_reads_our_tars(image_shards):
    wds = pytest.importorskip("webdataset")
    root, manifest, expected = image_shards
    urls = [str(root / s.path) for s in manifest.shards]
    got = [
        {k: v for k, v in sample.items() if not k.startswith("__") or k == "__key__"}
        for sample in wds.WebDataset(urls, shardshuffle=False)
    ]
    assert got == expected
    assert list(open_dataset(str(root))) == expected


def test_dali_reads_our_tars_with_our_idx(image_shards):
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    root, manifest, expected = image_shards
    paths = [str(root / s.path) for s in manifest.shards]
    index_paths = [p[: -len(".tar")] + ".idx" for p in paths]

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def pipe():
        return tuple(
            fn.readers.webdataset(
                paths=paths,
                index_paths=index_paths,
                ext=list(FIELDS),
                missing_component_behavior="error",
                random_shuffle=False,
                name="reader",
            )
        )

    p = pipe()
    p.build()
    assert p.epoch_size("reader") == len(expected)
    got = []
    for _ in range(len(expected)):
        outputs = p.run()
        got.append({f: np.array(out[0]).tobytes() for f, out in zip(FIELDS, outputs, strict=True)})
    assert got == [{f: e[f] for f in FIELDS} for e in expected]


def test_webdataset_writers_open_with_open_dataset(tmp_path):
    wds = pytest.importorskip("webdataset")
    images = jpeg_bytes(12, seed=5, sizes=((64, 48),))
    samples = [
        {"__key__": f"s{i:03d}", "jpg": img, "cls": i % 3, "json": {"i": i}} for i, img in enumerate(images)
    ]
    with wds.TarWriter(str(tmp_path / "single.tar")) as sink:
        for s in samples:
            sink.write(s)
    os.makedirs(tmp_path / "many")
    with wds.ShardWriter(str(tmp_path / "many" / "part-%04d.tar"), maxcount=5, verbose=0) as sink:
        for s in samples:
            sink.write(s)
    for url in (
        str(tmp_path / "single.tar"),
        str(tmp_path / "many"),
        str(tmp_path / "many" / "part-{0000..0002}.tar"),
    ):
        ds = open_dataset(url)
        assert len(ds) == 12
        for i, got in enumerate(ds):
            assert got["__key__"] == f"s{i:03d}"
            assert got["jpg"] == images[i]
            assert got["cls"] == str(i % 3).encode()
            assert got["json"].replace(b" ", b"") == f'{{"i":{i}}}'.encode()
    assert open_dataset(str(tmp_path / "many")).shard_sizes == [5, 5, 2]


def test_plain_pyarrow_reads_our_arrow_shards(tmp_path):
    rows = [
        {
            "__key__": f"r{i:03d}",
            "tokens": np.arange(i % 7, dtype=np.int64),
            "text": f"row {i}",
            "label": i % 2,
        }
        for i in range(25)
    ]
    with ShardWriter(str(tmp_path), format="arrow", max_samples=10) as w:
        for r in rows:
            w.write(r)
    manifest = Manifest.load(str(tmp_path))
    table_rows = []
    for shard in manifest.shards:
        with ipc.open_file(str(tmp_path / shard.path)) as reader:
            table_rows += reader.read_all().to_pylist()
    assert table_rows == [{**r, "tokens": r["tokens"].tolist()} for r in rows]
    ours = list(open_dataset(str(tmp_path)))
    assert [{**r, "tokens": r["tokens"].tolist()} for r in ours] == table_rows
