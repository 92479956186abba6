"""``stallfree shard`` of a stallfree dataset re-shards it sample by sample (issue 36 item 6).

It used to take a dataset directory for a folder of files: five "samples", each a whole .tar,
.idx, .sums or the manifest, rc 0; ``shard DS DS --overwrite`` then replaced the dataset with
those and deleted its shards. A destination that is the source, or lies inside it (or, with
``--overwrite``, holds it) is refused before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stallfree.cli import main
from stallfree.errors import WriteError
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.shards.writer import ShardWriter

from .conftest import make_samples


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def rows(url: Path) -> list[dict]:
    return [dict(s) for s in open_dataset(str(url))]


def same_rows(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return False
        for k in x:
            if isinstance(x[k], np.ndarray) or isinstance(y[k], np.ndarray):
                if not np.array_equal(x[k], y[k]) or x[k].dtype != y[k].dtype:
                    return False
            elif x[k] != y[k]:
                return False
    return True


def shard_cli(*args: str | Path) -> int:
    return main(["shard", *map(str, args), "--no-progress"])


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_a_dataset_is_resharded_sample_by_sample(tmp_path, fmt):
    src = tmp_path / "ds"
    with ShardWriter(str(src), format=fmt, max_samples=5, classes=[f"c{i}" for i in range(5)]) as w:
        for s in make_samples(13):
            if fmt == "arrow":
                s["emb"] = np.arange(s["cls"], dtype=np.float32)
            w.write(s)
    assert open_source(str(src)).kind == "dataset"
    assert open_source(str(src / "manifest.json")).kind == "dataset"
    assert shard_cli(src, tmp_path / "ds2", "--format", fmt, "--max-samples", "4") == 0
    before, after = rows(src), rows(tmp_path / "ds2")
    assert [r["__key__"] for r in after] == [f"sample{i:05d}" for i in range(13)]
    assert same_rows(before, after)
    ds2 = open_dataset(str(tmp_path / "ds2"))
    assert len(ds2.manifest.shards) == 4 and ds2.manifest.classes == [f"c{i}" for i in range(5)]


def test_tars_with_their_idx_are_a_dataset_not_files(tmp_path, tar_dataset):
    """Without a manifest: tars with an .idx beside each (a WebDataset with DALI indexes)."""
    (tar_dataset / "manifest.json").unlink()
    assert open_source(str(tar_dataset)).kind == "dataset"
    assert shard_cli(tar_dataset, tmp_path / "out", "--max-samples", "10") == 0
    assert same_rows(rows(tar_dataset), rows(tmp_path / "out"))


@pytest.mark.parametrize("dst", [".", "sub", "sub/deeper", "sub/..", "../tards"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_destination_in_the_source_is_refused_and_the_source_kept(tar_dataset, dst, overwrite, capsys):
    before = snapshot(tar_dataset)
    flags = ["--overwrite"] if overwrite else []
    assert shard_cli(tar_dataset, tar_dataset / dst, *flags) != 0
    err = capsys.readouterr().err
    assert f"the source {tar_dataset}" in err and "would be written into the data being read" in err
    assert snapshot(tar_dataset) == before  # nothing written, nothing removed


def test_the_library_refuses_it_too(tmp_path):
    """``shard_dataset`` callers get the same checks: a folder source and a destination inside
    it; with overwrite, a destination that holds the source (through a symbolic link too)."""
    images = tmp_path / "data" / "raw"
    images.mkdir(parents=True)
    for i in range(3):
        (images / f"{i}.txt").write_text(f"text {i}")
    with pytest.raises(WriteError, match="lies inside the source"):
        shard_dataset(str(images), str(images / "shards"))
    (tmp_path / "link").symlink_to(tmp_path / "data", target_is_directory=True)
    with pytest.raises(WriteError, match="lies inside the destination"):
        shard_dataset(str(images), str(tmp_path / "link"), overwrite=True)
    assert sorted(p.name for p in (tmp_path / "data").rglob("*")) == ["0.txt", "1.txt", "2.txt", "raw"]
    summary = shard_dataset(str(images), str(tmp_path / "data"))  # beside it, not replacing: fine
    assert summary.manifest.samples == 3


def test_an_arrow_dataset_keeps_its_column_types(tmp_path):
    """Re-sharding Arrow to Arrow takes the first shard's schema, not one inferred again from
    the values (an int16 column came back int64)."""
    src = tmp_path / "typed"
    with ShardWriter(str(src), format="arrow", max_samples=4) as w:
        for i in range(6):
            w.write({"__key__": f"k{i}", "n": np.int16(i), "v": np.arange(i, dtype=np.float32)})
    assert shard_cli(src, tmp_path / "out", "--format", "arrow") == 0
    types = open_dataset(str(tmp_path / "out")).manifest.field_types
    assert types == open_dataset(str(src)).manifest.field_types == {"n": "int16", "v": "list<item: float>"}
    assert same_rows(rows(src), rows(tmp_path / "out"))


def test_files_listed_from_a_directory_have_it_as_their_source(tmp_path):
    """``shard tables/ tables/out``: the next run would list the shards in ``out`` among the
    source's files; a file beside the destination (``shard ./rows.jsonl ./out``) is fine."""
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "rows.jsonl").write_text('{"__key__": "a", "x": 1}\n{"__key__": "b", "x": 2}\n')
    with pytest.raises(WriteError, match="lies inside the source"):
        shard_dataset(str(tables), str(tables / "out"))
    assert sorted(p.name for p in tables.iterdir()) == ["rows.jsonl"]
    summary = shard_dataset(str(tables / "rows.jsonl"), str(tables / "out"))
    assert summary.manifest.samples == 2


def test_a_file_url_source_is_the_local_directory(tmp_path, tar_dataset, capsys):
    """``file:///abs/ds`` names the local directory: it was taken as the path ``file:/abs/ds``
    ("does not exist"); the destination checks see through it too."""
    before = snapshot(tar_dataset)
    assert shard_cli(f"file://{tar_dataset}", tar_dataset, "--overwrite") != 0
    assert "would be written into the data being read" in capsys.readouterr().err
    assert snapshot(tar_dataset) == before
    assert shard_cli(f"file://{tar_dataset}", tmp_path / "out", "--max-samples", "10") == 0
    assert same_rows(rows(tar_dataset), rows(tmp_path / "out"))
