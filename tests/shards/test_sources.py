"""Sources list items cheaply (paths + sizes) and read byte-identical samples lazily."""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.shards.sources.registry import (
    SourceError,
    SourceReadError,
    detect_kind,
    normalize_field,
    open_source,
    split_key_field,
)
from stallfree.testing.images import jpeg_bytes, make_image_folder


def _samples(source):
    out = []
    for s in source.read_many(source.items()):
        if isinstance(s, Exception):
            raise s
        out.append(s)
    return out


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    root = make_image_folder(
        tmp_path_factory.mktemp("imf") / "train", classes=3, per_class=2, sizes=((64, 48),)
    )
    (root / "class_01" / "img_01_00000.jpg").rename(root / "class_01" / "img_01_00000.JPEG")
    (root / "class_02" / "notes.txt").write_text("not an image")
    return root


def test_imagefolder_samples_classes_and_bytes(image_folder: Path) -> None:
    src = open_source(image_folder)
    assert src.kind == "imagefolder"
    assert src.classes == ["class_00", "class_01", "class_02"]
    items = src.items()
    assert [it.sizes[0] for it in items] == [
        os.path.getsize(p) for c in src.classes for p in sorted((image_folder / c).glob("img_*"))
    ]
    samples = _samples(src)
    assert [(s["__key__"], s["cls"]) for s in samples] == [
        ("class_00/img_00_00000", 0),
        ("class_00/img_00_00001", 0),
        ("class_01/img_01_00000", 1),
        ("class_01/img_01_00001", 1),
        ("class_02/img_02_00000", 2),
        ("class_02/img_02_00001", 2),
    ]
    assert all(set(s) == {"__key__", "jpg", "cls"} for s in samples)  # .JPEG normalised, .txt ignored
    assert samples[2]["jpg"] == (image_folder / "class_01" / "img_01_00000.JPEG").read_bytes()
    assert samples[5]["jpg"] == (image_folder / "class_02" / "img_02_00001.jpg").read_bytes()


def test_source_pickles_and_reads_in_another_process_state(image_folder: Path) -> None:
    src = open_source(image_folder)
    items = src.items()
    clone = pickle.loads(pickle.dumps(src))
    assert [s["jpg"] for s in clone.read_many(items[:2])] == [s["jpg"] for s in _samples(src)[:2]]


def test_grouped_files_by_basename(tmp_path: Path) -> None:
    imgs = jpeg_bytes(2, seed=1, sizes=((32, 32),))
    (tmp_path / "a.jpg").write_bytes(imgs[0])
    (tmp_path / "a.json").write_text('{"label": 1}')
    (tmp_path / "b.jpeg").write_bytes(imgs[1])
    (tmp_path / "b.seg.png").write_bytes(b"\x89PNG fake")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("hello")
    (tmp_path / ".hidden.jpg").write_bytes(b"x")
    src = open_source(tmp_path)
    assert src.kind == "files"
    assert _samples(src) == [
        {"__key__": "a", "jpg": imgs[0], "json": b'{"label": 1}'},
        {"__key__": "b", "jpg": imgs[1], "seg.png": b"\x89PNG fake"},
        {"__key__": "sub/c", "txt": b"hello"},
    ]


def test_grouped_files_conflicting_field_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"1")
    (tmp_path / "a.jpeg").write_bytes(b"2")
    with pytest.raises(SourceError, match="already has a field 'jpg'"):
        open_source(tmp_path, "files").items()


def test_jsonl_rows_keys_and_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"key": "r0", "n": 1, "t": "x", "v": [1, 2]}\n\n{"n": 2.5, "t": null}\n{oops\n')
    src = open_source(path)
    assert src.kind == "jsonl"
    results = list(src.read_many(src.items()))
    assert results[0] == {"__key__": "r0", "key": "r0", "n": 1, "t": "x", "v": [1, 2]}
    assert results[1] == {"__key__": "000000001", "n": 2.5}
    assert isinstance(results[2], SourceReadError)
    assert results[2].path == str(path) and "line 4 is not valid JSON" in str(results[2])


def test_parquet_rows_keep_types_across_row_groups(tmp_path: Path) -> None:
    table = pa.table(
        {
            "__key__": [f"k{i}" for i in range(5)],
            "tokens": pa.array([[i, i + 1] for i in range(5)], pa.list_(pa.int32())),
            "score": pa.array([0.5 * i for i in range(5)], pa.float32()),
            "blob": [bytes([i]) * 3 for i in range(5)],
        }
    )
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=2)
    pq.write_table(table.slice(0, 1), tmp_path / "part-1.parquet")
    src = open_source(tmp_path)
    assert src.kind == "parquet"
    assert src.schema().field("score").type == pa.float32()
    samples = _samples(src)
    assert [s["__key__"] for s in samples] == ["k0", "k1", "k2", "k3", "k4", "k0"]
    assert samples[3] == {"__key__": "k3", "tokens": [3, 4], "score": 1.5, "blob": b"\x03\x03\x03"}
    assert all(it.size > 0 for it in src.items())


def test_arrow_ipc_file_and_row_number_keys(tmp_path: Path) -> None:
    table = pa.table({"x": pa.array(range(4), pa.int16()), "s": ["a", "b", "c", "d"]})
    with pa.ipc.new_file(tmp_path / "t.arrow", table.schema) as w:
        for batch in table.to_batches(max_chunksize=3):
            w.write_batch(batch)
    src = open_source(tmp_path / "t.arrow")
    assert [s["__key__"] for s in _samples(src)] == ["000000000", "000000001", "000000002", "000000003"]
    assert _samples(src)[3] == {"__key__": "000000003", "x": 3, "s": "d"}


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_tar_source_groups_members_byte_identical(tmp_path: Path) -> None:
    imgs = jpeg_bytes(3, seed=2, sizes=((40, 30),))
    _write_tar(tmp_path / "a.tar", [("s0.jpg", imgs[0]), ("s0.cls", b"3"), ("d/s1.jpg", imgs[1])])
    _write_tar(tmp_path / "b.tar", [("s2.jpg", imgs[2]), ("s2.cls", b"7")])
    src = open_source(str(tmp_path / "*.tar"))
    assert src.kind == "tar"
    assert _samples(src) == [
        {"__key__": "s0", "jpg": imgs[0], "cls": b"3"},
        {"__key__": "d/s1", "jpg": imgs[1]},
        {"__key__": "s2", "jpg": imgs[2], "cls": b"7"},
    ]


def test_truncated_tar_raises_or_is_skipped(tmp_path: Path) -> None:
    _write_tar(tmp_path / "a.tar", [("s0.bin", b"x" * 2000)])
    _write_tar(tmp_path / "b.tar", [("s1.bin", b"y" * 10)])
    data = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "a.tar").write_bytes(data[:1000])
    with pytest.raises(SourceReadError, match="a.tar") as info:
        open_source(tmp_path, "tar").items()
    assert info.value.path == str(tmp_path / "a.tar")
    src = open_source(tmp_path, "tar", on_error="skip")
    assert _samples(src) == [{"__key__": "s1", "bin": b"y" * 10}]
    assert [s["source"] for s in src.skipped] == [str(tmp_path / "a.tar")]


def test_unreadable_file_listing_raise_and_skip(image_folder: Path, tmp_path: Path) -> None:
    root = tmp_path / "imf"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "ok.jpg").write_bytes(b"jpegdata")
    os.symlink(tmp_path / "nowhere.jpg", root / "cat" / "broken.jpg")
    with pytest.raises(SourceReadError, match="broken.jpg"):
        open_source(root).items()
    src = open_source(root, on_error="skip")
    assert [s["__key__"] for s in _samples(src)] == ["cat/ok"]
    assert src.skipped[0]["source"].endswith("broken.jpg")


def test_file_vanishing_after_listing_yields_read_error(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"1")
    (tmp_path / "b.bin").write_bytes(b"2")
    src = open_source(tmp_path, "files")
    items = src.items()
    (tmp_path / "a.bin").unlink()
    first, second = src.read_many(items)
    assert isinstance(first, SourceReadError) and first.path == str(tmp_path / "a.bin")
    assert first.key == "a"
    assert pickle.loads(pickle.dumps(first)).path == first.path
    assert second == {"__key__": "b", "bin": b"2"}


def test_detection_and_bad_sources(tmp_path: Path) -> None:
    assert normalize_field(".JPEG") == "jpg" and normalize_field("png") == "png"
    assert split_key_field("dir/a.b.c") == ("dir/a", "b.c")
    assert split_key_field("noext") == ("", "")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="cannot tell the source kind"):
        detect_kind([str(tmp_path / "x.csv")])
    with pytest.raises(SourceError, match="does not exist"):
        open_source(tmp_path / "missing")
    with pytest.raises(SourceError, match="no files match"):
        open_source(str(tmp_path / "*.tar"))
    with pytest.raises(SourceError, match="unknown source kind"):
        open_source(tmp_path, "zip")
    with pytest.raises(ValueError, match="on_error"):
        open_source(tmp_path, on_error="ignore")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"a": 1}) + "\n")
    assert open_source(str(tmp_path / "rows.jsonl")).kind == "jsonl"


def test_every_name_still_imports_from_sources():
    """``sources`` is split into one module per kind; the old import path keeps every name, and
    they are the very objects the kind modules define (pickles and isinstance checks agree)."""
    from stallfree.shards.sources import base as source_base
    from stallfree.shards.sources import files as source_files
    from stallfree.shards.sources import hf as source_hf
    from stallfree.shards.sources import litdata as source_litdata
    from stallfree.shards.sources import mds as source_mds
    from stallfree.shards.sources import registry as sources
    from stallfree.shards.sources import tables as source_tables
    from stallfree.shards.sources import tar as source_tar

    home = {
        "Item": source_base,
        "Source": source_base,
        "SourceError": source_base,
        "SourceReadError": source_base,
        "normalize_field": source_base,
        "split_key_field": source_base,
        "ImageFolderSource": source_files,
        "GroupedFilesSource": source_files,
        "IMAGE_EXTENSIONS": source_files,
        "TableSource": source_tables,
        "TABLE_SUFFIXES": source_tables,
        "KEY_COLUMNS": source_tables,
        "TarSource": source_tar,
        "HFTableSource": source_hf,
        "HFDatasetSource": source_hf,
        "MDSSource": source_mds,
        "LitDataSource": source_litdata,
    }
    for name, module in home.items():
        assert getattr(sources, name) is getattr(module, name), name
    assert set(sources.__all__) == set(home) | {"SOURCE_KINDS", "detect_kind", "open_source"}
    from stallfree.cli import shard as shard_cli  # keeps its own copy so --help imports nothing heavy

    assert shard_cli.SOURCE_KINDS == sources.SOURCE_KINDS


def test_detect_kind_from_suffixes(tmp_path: Path) -> None:
    """Files and a directory of files are judged by the same suffix rule."""
    for sub, names in {
        "tars": ["a.tar", "b.tar"],
        "jsonl": ["a.jsonl", "b.ndjson"],
        "mixed": ["a.tar", "b.parquet"],
        "other": ["a.jpg", "a.txt"],
    }.items():
        (tmp_path / sub).mkdir()
        for name in names:
            (tmp_path / sub / name).write_bytes(b"")
    files = {sub: sorted(str(p) for p in (tmp_path / sub).iterdir()) for sub in ("tars", "jsonl", "mixed")}
    assert [detect_kind(files[sub]) for sub in ("tars", "jsonl")] == ["tar", "jsonl"]
    with pytest.raises(SourceError, match=r"suffixes \['.parquet', '.tar'\]"):
        detect_kind(files["mixed"])
    assert [detect_kind([str(tmp_path / sub)]) for sub in ("tars", "jsonl", "mixed", "other")] == [
        "tar",
        "jsonl",
        "files",
        "files",
    ]


def test_table_files_opened_once_per_read_not_per_batch(tmp_path, monkeypatch):
    """An Arrow stream is parsed whole each time it is opened; shuffled rows spanning many small
    record batches re-opened the file per batch (slower than the rows themselves: an HF
    save_to_disk directory sharded at a third of its later speed)."""
    import random

    import pyarrow as pa

    from stallfree.shards.sources import tables as source_tables

    paths = []
    for f in range(2):
        path = tmp_path / f"part{f}.arrow"
        table = pa.table({"v": list(range(f * 100, f * 100 + 100))})
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=7):
                w.write_batch(batch)
        paths.append(str(path))
    opened = []
    real = source_tables._open_ipc

    class counting(real):
        def __enter__(self):
            opened.append(self.path)
            return super().__enter__()

    monkeypatch.setattr(source_tables, "_open_ipc", counting)
    source = open_source(paths, "arrow")
    items = source.items()
    opened.clear()
    shuffled = random.Random(0).sample(items, len(items))
    got = [s["v"] for s in source.read_many(shuffled)]
    assert got == [it.ref[3] for it in shuffled]  # rows in the asked order
    assert sorted(opened) == paths  # each file once, not once per 7-row batch
    opened.clear()
    assert [s["v"] for s in source.read_many(items)] == list(range(200))
    assert len(opened) <= 2
