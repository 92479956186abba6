"""Sharding every source kind: exact samples and bytes, identical output for any worker count,
deterministic boundaries, error policy, and nothing left behind on failure."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.errors import WriteError
from stallfree.shards.parallel import item_cost, plan_shards, shard_dataset
from stallfree.shards.sources.registry import Item, SourceReadError, open_source
from stallfree.testing.images import jpeg_bytes, make_image_folder


def read_tar(path: Path) -> list[dict]:
    """Samples of a tar via the standard library (independent of our reader)."""
    samples: list[dict] = []
    with tarfile.open(path) as tf:
        for m in tf:
            key, _, field = m.name.partition(".")
            if not samples or samples[-1]["__key__"] != key:
                samples.append({"__key__": key})
            samples[-1][field] = tf.extractfile(m).read()
    return samples


def dataset_samples(root: Path) -> list[dict]:
    manifest = json.loads((root / "manifest.json").read_text())
    return [s for shard in manifest["shards"] for s in read_tar(root / shard["path"])]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(
        tmp_path_factory.mktemp("src") / "imf", classes=3, per_class=5, sizes=((48, 40),)
    )


def test_imagefolder_to_tar_exact_samples_bytes_and_classes(folder: Path, tmp_path: Path) -> None:
    summary = shard_dataset(open_source(folder), str(tmp_path / "out"), max_samples=4, shuffle_seed=None)
    samples = dataset_samples(tmp_path / "out")
    expected = [
        {"__key__": f"{c.name}/{p.stem}", "cls": str(i).encode(), "jpg": p.read_bytes()}
        for i, c in enumerate(sorted(folder.iterdir()))
        for p in sorted(c.iterdir())
    ]
    assert samples == expected
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["classes"] == ["class_00", "class_01", "class_02"]
    assert manifest["fields"] == ["cls", "jpg"]
    assert [s["samples"] for s in manifest["shards"]] == [4, 4, 4, 3]
    assert summary.samples == 15 and summary.to_json()["shards"] == 4
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        ["manifest.json"] + [f"shard-{i:06d}.{ext}" for i in range(4) for ext in ("tar", "idx", "sums")]
    )


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_output_identical_for_one_and_three_workers(folder: Path, tmp_path: Path, fmt: str) -> None:
    for workers in (1, 3):
        shard_dataset(
            open_source(folder),
            str(tmp_path / f"w{workers}"),
            format=fmt,
            max_samples=3,
            workers=workers,
            shuffle_seed=7,
        )
    one, three = tree(tmp_path / "w1"), tree(tmp_path / "w3")
    assert len(one) == (5 * 3 + 1 if fmt == "tar" else 5 + 1)  # tar: .tar, .idx, .sums
    assert one == three


def test_shuffle_seed_permutes_deterministically(folder: Path, tmp_path: Path) -> None:
    keys = {}
    for name, seed in (("a", 3), ("b", 3), ("plain", None)):
        shard_dataset(open_source(folder), str(tmp_path / name), shuffle_seed=seed)
        keys[name] = [s["__key__"] for s in dataset_samples(tmp_path / name)]
    assert keys["a"] == keys["b"] != keys["plain"]
    assert sorted(keys["a"]) == keys["plain"]


def test_max_bytes_boundaries_are_greedy_and_exact_for_tar(folder: Path, tmp_path: Path) -> None:
    source = open_source(folder)
    items = source.items()
    limit = 12_000
    plan = plan_shards(items, "tar", max_bytes=limit)
    summary = shard_dataset(source, str(tmp_path / "out"), max_bytes=limit, shuffle_seed=None)
    sizes = [s.bytes for s in summary.manifest.shards]
    assert [s.samples for s in summary.manifest.shards] == [len(p) for p in plan]
    for shard, nbytes in zip(plan, sizes, strict=True):
        assert nbytes == 1024 + sum(item_cost(items[i], "tar") for i in shard)  # planned == written
        assert nbytes <= limit
    for shard, nxt in zip(
        plan, plan[1:], strict=False
    ):  # each shard closed only when the next item did not fit
        assert 1024 + sum(item_cost(items[i], "tar") for i in shard + [nxt[0]]) > limit


def test_plan_limits_and_oversized_item() -> None:
    items = [Item(str(i), (s,), None) for i, s in enumerate([100, 5000, 100, 100, 100])]
    assert plan_shards(items, "tar", max_bytes=4096) == [[0], [1], [2, 3, 4]]
    assert plan_shards(items, "tar", max_bytes=None, max_samples=2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="max_samples"):
        plan_shards(items, "tar", max_samples=0)
    with pytest.raises(ValueError, match="format"):
        plan_shards(items, "zip")


def test_parquet_to_arrow_keeps_column_types(tmp_path: Path) -> None:
    table = pa.table(
        {
            "tokens": pa.array([[i] * (i + 1) for i in range(7)], pa.list_(pa.int32())),
            "score": pa.array([i / 4 for i in range(7)], pa.float32()),
            "text": [f"row {i}" for i in range(7)],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    shard_dataset(open_source(tmp_path / "t.parquet"), str(tmp_path / "out"), format="arrow", max_samples=4)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["field_types"] == {"tokens": "list<element: int32>", "score": "float", "text": "string"}
    parts = []
    for shard in manifest["shards"]:
        with pa.ipc.open_file(tmp_path / "out" / shard["path"]) as reader:
            parts.append(reader.read_all())
    back = pa.concat_tables(parts)
    assert back.column("__key__").to_pylist() == [f"{i:09d}" for i in range(7)]
    assert back.schema.field("score").type == pa.float32()
    assert back.schema.field("tokens").type.value_type == pa.int32()
    assert back.select(["tokens", "score", "text"]).to_pylist() == table.to_pylist()


def test_jsonl_to_tar_encodes_values(tmp_path: Path) -> None:
    rows = [{"__key__": "a", "n": 3, "t": "hé", "v": [1, 2]}, {"__key__": "b", "n": 4, "x": 0.5}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shard_dataset(open_source(tmp_path / "rows.jsonl"), str(tmp_path / "out"))
    assert dataset_samples(tmp_path / "out") == [
        {"__key__": "a", "n": b"3", "t": "hé".encode(), "v": b"[1, 2]"},
        {"__key__": "b", "n": b"4", "x": b"0.5"},
    ]


def test_reshard_tars_byte_identical_and_readable_by_webdataset(tmp_path: Path) -> None:
    import webdataset as wds

    imgs = jpeg_bytes(6, seed=5, sizes=((40, 30),))
    (tmp_path / "in").mkdir()
    for part in range(2):
        with wds.TarWriter(str(tmp_path / "in" / f"p{part}.tar")) as w:
            for i in range(3):
                w.write({"__key__": f"s{part}{i}", "jpg": imgs[part * 3 + i], "json": b'{"i": %d}' % i})
    shard_dataset(open_source(tmp_path / "in"), str(tmp_path / "out"), max_samples=4, workers=2)
    got = dataset_samples(tmp_path / "out")
    assert [s["jpg"] for s in got] == imgs
    assert [s["__key__"] for s in got] == ["s00", "s01", "s02", "s10", "s11", "s12"]
    urls = [str(p) for p in sorted((tmp_path / "out").glob("*.tar"))]
    back = list(wds.WebDataset(urls, shardshuffle=False))
    assert [(s["__key__"], s["jpg"], s["json"]) for s in back] == [
        (s["__key__"], s["jpg"], s["json"]) for s in got
    ]


def test_grouped_files_to_tar(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    for name, data in (("a.jpg", b"A"), ("a.json", b"{}"), ("b.jpg", b"B")):
        (tmp_path / "src" / name).write_bytes(data)
    shard_dataset(open_source(tmp_path / "src"), str(tmp_path / "out"))
    assert dataset_samples(tmp_path / "out") == [
        {"__key__": "a", "jpg": b"A", "json": b"{}"},
        {"__key__": "b", "jpg": b"B"},
    ]


def test_on_error_skip_lists_files_in_manifest(folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "imf"
    (src / "dogs").mkdir(parents=True)
    (src / "dogs" / "ok.jpg").write_bytes(b"ok")
    os.symlink(tmp_path / "gone.jpg", src / "dogs" / "broken.jpg")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"a": 1}\n{bad\n{"a": 3}\n')
    summary = shard_dataset(open_source(src, on_error="skip"), str(tmp_path / "o1"), on_error="skip")
    assert [s["__key__"] for s in dataset_samples(tmp_path / "o1")] == ["dogs/ok"]
    assert [s["source"] for s in summary.skipped] == [str(src / "dogs" / "broken.jpg")]
    summary = shard_dataset(
        open_source(rows, on_error="skip"), str(tmp_path / "o2"), on_error="skip", workers=2
    )
    manifest = json.loads((tmp_path / "o2" / "manifest.json").read_text())
    assert (
        manifest["skipped"][0]["source"] == f"{rows}:2"
        and "not valid JSON" in manifest["skipped"][0]["error"]
    )
    assert summary.samples == 2


def test_all_items_of_a_shard_skipped_leaves_no_empty_shard(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"a": 1}\n{bad\n{bad\n{"a": 4}\n')
    summary = shard_dataset(open_source(rows), str(tmp_path / "out"), max_samples=2, on_error="skip")
    assert [s.path for s in summary.manifest.shards] == ["shard-000000.tar", "shard-000001.tar"]
    assert [s.samples for s in summary.manifest.shards] == [1, 1]
    assert len(summary.skipped) == 2


@pytest.mark.parametrize("workers", [1, 2])
def test_failure_leaves_nothing_under_final_names(tmp_path: Path, workers: int) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"a": i}) + "\n" for i in range(9)) + "{bad\n")
    with pytest.raises(SourceReadError, match=r"rows.jsonl: line 10 is not valid JSON"):
        shard_dataset(open_source(rows), str(tmp_path / "out"), max_samples=2, workers=workers)
    assert os.listdir(tmp_path / "out") == []


def test_fsspec_destination_and_overwrite(folder: Path, tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    shard_dataset(open_source(folder), "memory://stallfree-test/ds", max_samples=8)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/stallfree-test/ds", detail=False)) == [
        "manifest.json",
        "shard-000000.idx",
        "shard-000000.sums",
        "shard-000000.tar",
        "shard-000001.idx",
        "shard-000001.sums",
        "shard-000001.tar",
    ]
    with tarfile.open(fileobj=io.BytesIO(fs.cat_file("/stallfree-test/ds/shard-000001.tar"))) as tf:
        assert len(tf.getnames()) == 14
    with pytest.raises(WriteError, match="already holds a dataset"):
        shard_dataset(open_source(folder), "memory://stallfree-test/ds")
    shard_dataset(open_source(folder), "memory://stallfree-test/ds", overwrite=True)
    # the new generation takes names the old dataset did not use; the old files go after the commit
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/stallfree-test/ds", detail=False)) == [
        "manifest.json",
        "shard-000000.g1.idx",
        "shard-000000.g1.sums",
        "shard-000000.g1.tar",
    ]
    fs.rm("/stallfree-test", recursive=True)


@pytest.mark.parametrize("overlap", [True, False])
def test_shard_bytes_and_hash_match_plain_tar_writer(
    folder: Path, tmp_path: Path, monkeypatch, overlap: bool
) -> None:
    import hashlib

    from stallfree.shards import parallel
    from stallfree.shards.tar.writer import TarShardWriter

    monkeypatch.setattr(parallel, "_OVERLAP_HASH", overlap)
    source = open_source(folder)
    summary = shard_dataset(source, str(tmp_path / "ours"), max_bytes=10**9, shuffle_seed=None)
    with TarShardWriter(str(tmp_path / "plain.tar")) as w:
        for sample in source.read_many(source.items()):
            w.write(sample)
    ours = (tmp_path / "ours" / "shard-000000.tar").read_bytes()
    assert ours == (tmp_path / "plain.tar").read_bytes()
    assert summary.manifest.shards[0].sha256 == hashlib.sha256(ours).hexdigest() == w.info.sha256
    assert (tmp_path / "ours" / "shard-000000.idx").read_bytes() == (tmp_path / "plain.idx").read_bytes()


def test_empty_source_is_an_error(tmp_path: Path) -> None:
    from stallfree.shards.sources.registry import SourceError

    (tmp_path / "rows.jsonl").write_text("\n\n")
    with pytest.raises(SourceError, match="no samples to shard in the jsonl source"):
        shard_dataset(open_source(tmp_path / "rows.jsonl"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_memory_destination_with_workers_falls_back_to_one(folder: Path) -> None:
    fs = fsspec.filesystem("memory")
    summary = shard_dataset(open_source(folder), "memory://stallfree-w/ds", max_samples=4, workers=3)
    assert summary.samples == 15 and len(fs.ls("/stallfree-w/ds", detail=False)) == 13
    fs.rm("/stallfree-w", recursive=True)


def test_shuffled_parquet_rows_read_each_row_group_once_per_shard(tmp_path: Path, monkeypatch) -> None:
    from stallfree.shards.sources.registry import TableSource

    table = pa.table({"x": pa.array(range(40), pa.int32()), "s": [f"v{i}" for i in range(40)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=8)
    loads: list[tuple[int, int]] = []
    original = TableSource._load_chunk
    monkeypatch.setattr(
        TableSource, "_load_chunk", lambda self, fi, c: loads.append((fi, c)) or original(self, fi, c)
    )
    summary = shard_dataset(
        open_source(tmp_path / "t.parquet"),
        str(tmp_path / "out"),
        format="arrow",
        max_samples=20,
        shuffle_seed=1,
    )
    assert len(loads) <= 2 * 5 and summary.samples == 40
    rows = []
    for shard in summary.manifest.shards:
        with pa.ipc.open_file(tmp_path / "out" / shard.path) as reader:
            rows.extend(reader.read_all().to_pylist())
    assert sorted((r["x"], r["s"]) for r in rows) == [(i, f"v{i}") for i in range(40)]
    assert [r["x"] for r in rows] != list(range(40))
    assert all(r["__key__"] == f"{r['x']:09d}" for r in rows)


def test_bad_settings_are_rejected_before_writing(folder: Path, tmp_path: Path) -> None:
    for kwargs, message in (
        ({"name": "shard-{i}"}, "bad shard name pattern"),
        ({"name": "fixed"}, "must be a plain file name containing '{index}'"),
        ({"workers": 0}, "workers must be >= 1"),
        ({"on_error": "ignore"}, "on_error"),
        ({"format": "zip"}, "format must be 'tar' or 'arrow'"),
    ):
        with pytest.raises(ValueError, match=message):
            shard_dataset(open_source(folder), str(tmp_path / "out"), **kwargs)
    assert not (tmp_path / "out").exists()


def test_grouped_sources_are_shuffled_by_default_and_the_seed_recorded(folder: Path, tmp_path: Path) -> None:
    """Issue 19.4: class-sorted shards (shard 0 = one class) gave in-order readers (WebDataset,
    DALI) near-single-class batches. ImageFolder now shards shuffled unless told not to."""
    default = shard_dataset(open_source(folder), str(tmp_path / "default"), max_samples=5)
    seeded = shard_dataset(open_source(folder), str(tmp_path / "seed0"), max_samples=5, shuffle_seed=0)
    plain = shard_dataset(open_source(folder), str(tmp_path / "plain"), max_samples=5, shuffle_seed=None)
    assert tree(tmp_path / "default") == tree(tmp_path / "seed0")  # the default is seed 0, exactly
    assert default.manifest.extra["shuffle_seed"] == 0 and default.to_json()["shuffle_seed"] == 0
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["shuffle_seed"] is None
    assert seeded.samples == plain.samples == 15
    first = [s["cls"] for s in dataset_samples(tmp_path / "default")[:5]]
    assert len(set(first)) > 1  # shard 0 holds more than one class
    in_order = [s["cls"] for s in dataset_samples(tmp_path / "plain")]
    assert in_order == sorted(in_order)
    keys = sorted(s["__key__"] for s in dataset_samples(tmp_path / "default"))
    assert keys == [s["__key__"] for s in dataset_samples(tmp_path / "plain")]


def test_tables_keep_their_order_by_default(tmp_path: Path) -> None:
    rows = [{"__key__": f"r{i:03d}", "v": i} for i in range(12)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = shard_dataset(open_source(tmp_path / "rows.jsonl"), str(tmp_path / "out"), max_samples=5)
    assert [s["__key__"] for s in dataset_samples(tmp_path / "out")] == [r["__key__"] for r in rows]
    assert summary.manifest.extra["shuffle_seed"] is None
    shard_dataset(open_source(tmp_path / "rows.jsonl"), str(tmp_path / "mixed"), shuffle_seed=4)
    assert json.loads((tmp_path / "mixed" / "manifest.json").read_text())["shuffle_seed"] == 4
    with pytest.raises(ValueError, match="shuffle_seed must be an int, None or 'auto'"):
        shard_dataset(open_source(tmp_path / "rows.jsonl"), str(tmp_path / "bad"), shuffle_seed="7")


def test_cli_no_shuffle_and_shuffle_seed(folder: Path, tmp_path: Path) -> None:
    from stallfree.cli import main

    assert main(["shard", str(folder), str(tmp_path / "n"), "--no-shuffle", "--no-progress"]) == 0
    assert main(["shard", str(folder), str(tmp_path / "s"), "--shuffle-seed", "5", "--no-progress"]) == 0
    assert json.loads((tmp_path / "n" / "manifest.json").read_text())["shuffle_seed"] is None
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["shuffle_seed"] == 5
    with pytest.raises(SystemExit):
        main(["shard", str(folder), str(tmp_path / "x"), "--no-shuffle", "--shuffle-seed", "1"])
