"""What ``open_dataset`` says of directories it cannot read as they are (a ``DatasetDict``, an
unknown layout, an ``index.json`` of neither MDS nor LitData), and symbolic links inside MDS,
LitData and Hugging Face datasets that lead out of the dataset (refused, naming the link and its
target; links that stay inside are followed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stallfree.cli import main
from stallfree.errors import ShardError
from stallfree.shards.dataset_paths import OutsideDatasetError
from stallfree.shards.open import open_dataset
from stallfree.shards.sources.registry import open_source
from tests.shards.test_source_litdata import write_litdata
from tests.shards.test_source_mds import write_mds

ROWS = [{"image": bytes([i]) * 50, "label": i} for i in range(6)]


def _mds(root: Path) -> Path:
    write_mds(root, {"image": "bytes", "label": "int"}, ROWS, per_shard=3)
    return root


def _litdata(root: Path) -> Path:
    write_litdata(root, ROWS, per_chunk=3)
    return root


def test_a_dataset_dict_names_its_splits_in_open_dataset_too(tmp_path):
    root = tmp_path / "dd"
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(
        ShardError, match=r"DatasetDict with splits train, test: open one split directory"
    ) as info:
        open_dataset(str(root))
    assert str(root / "train") in str(info.value)
    with pytest.raises(ShardError, match=r"DatasetDict with splits train, test"):
        open_source(str(root))


def test_a_directory_of_no_known_layout_says_what_it_looked_for(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(ShardError) as info:
        open_dataset(str(tmp_path / "photos"))
    message = str(info.value)
    for looked_for in (
        "manifest.json",
        ".tar",
        ".parquet",
        "index.json",
        "MosaicML MDS",
        "LitData",
        "save_to_disk",
    ):
        assert looked_for in message
    assert f"stallfree shard {tmp_path / 'photos'} DST" in message


def test_an_index_json_of_neither_format_is_named(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "index.json").write_text(json.dumps({"files": []}))
    with pytest.raises(
        ShardError, match=r"index.json is not an index open_dataset reads \(MDS, LitData"
    ) as info:
        open_dataset(str(tmp_path / "x"))
    assert str(tmp_path / "x" / "index.json") in str(info.value)


@pytest.mark.parametrize("make, name", [(_mds, "shard.00001.mds"), (_litdata, "chunk-0-1.bin")])
def test_a_shard_linked_out_of_the_dataset_is_refused(make, name, tmp_path, capsys):
    root = make(tmp_path / "ds")
    outside = tmp_path / "elsewhere.bin"
    (root / name).rename(outside)
    os.symlink(outside, root / name)
    for opener in (open_dataset, open_source):
        with pytest.raises(OutsideDatasetError, match="symbolic link") as info:
            opener(str(root))
        message = str(info.value)
        assert str(root / name) in message and repr(str(outside)) in message, message
    capsys.readouterr()
    assert main(["shard", str(root), str(tmp_path / "out"), "--no-progress"]) != 0
    assert f"{root / name} is a symbolic link to {str(outside)!r}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make", [_mds, _litdata])
def test_an_index_linked_out_of_the_dataset_is_refused(make, tmp_path):
    root = make(tmp_path / "ds")
    outside = tmp_path / "their-index.json"
    (root / "index.json").rename(outside)
    os.symlink(outside, root / "index.json")
    for opener in (open_dataset, open_source):
        with pytest.raises(OutsideDatasetError, match=r"index.json is a symbolic link to"):
            opener(str(root))


@pytest.mark.parametrize("make, name", [(_mds, "shard.00001.mds"), (_litdata, "chunk-0-1.bin")])
def test_links_that_stay_inside_are_followed(make, name, tmp_path):
    root = make(tmp_path / "ds")
    expected = [open_dataset(str(root))[i] for i in range(len(ROWS))]
    (root / "store").mkdir()
    (root / name).rename(root / "store" / name)
    os.symlink(Path("store") / name, root / name)  # a relative link, inside the dataset
    assert [open_dataset(str(root))[i] for i in range(len(ROWS))] == expected


def test_a_hugging_face_data_file_linked_out_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    root = tmp_path / "hf"
    datasets.Dataset.from_dict({"x": list(range(40))}).save_to_disk(str(root), num_shards=2)
    data = sorted(p.name for p in root.glob("*.arrow"))
    assert len(data) >= 2
    outside = tmp_path / "elsewhere.arrow"
    (root / data[1]).rename(outside)
    os.symlink(outside, root / data[1])
    for opener in (open_dataset, open_source):
        with pytest.raises(OutsideDatasetError, match="symbolic link") as info:
            opener(str(root))
        assert str(root / data[1]) in str(info.value) and str(outside) in str(info.value)
