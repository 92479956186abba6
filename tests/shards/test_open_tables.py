"""Table files opened without a manifest: one schema for all of them (as pyarrow's datasets and
Hugging Face ``datasets`` require), and a warning whose advice actually works for tables."""

from __future__ import annotations

import logging
import shlex

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.errors import ShardError
from stallfree.shards.arrow.format import schema_differences
from stallfree.shards.open import open_dataset


def _tables(root, schemas):
    root.mkdir()
    for i, columns in enumerate(schemas):
        pq.write_table(pa.table(columns), root / f"part-{i}.parquet")


def test_a_glob_over_different_schemas_is_an_error_naming_files_and_fields(tmp_path):
    _tables(
        tmp_path / "mixed",
        [
            {"text": ["a", "b"], "label": [1, 2]},
            {"text": ["c"], "label": [3]},
            {"text": ["d"], "label": ["x"], "score": [0.5]},
        ],
    )
    with pytest.raises(ShardError) as info:
        open_dataset(str(tmp_path / "mixed" / "*.parquet"))
    assert str(info.value) == (
        "part-0.parquet and part-2.parquet have different schemas ('label' is int64 in part-0.parquet "
        "but string in part-2.parquet; 'score' only in part-2.parquet): the table files of one dataset "
        "must share one schema (open each kind separately, or mix them with stallfree.mix) "
        "(shard part-2.parquet)"
    )
    assert info.value.shard == "part-2.parquet"


def test_same_fields_in_another_order_open_as_one(tmp_path):
    _tables(tmp_path / "same", [{"a": [1], "b": ["x"]}, {"b": ["y"], "a": [2]}])
    ds = open_dataset(str(tmp_path / "same"))
    assert len(ds) == 2 and {ds[1]["a"], ds[1]["b"]} == {2, "y"}


def test_schema_differences_word_each_field():
    a = pa.schema([("x", pa.int32()), ("y", pa.string())])
    b = pa.schema([("x", pa.int64()), ("z", pa.string())])
    assert schema_differences(a, b, "A", "B") == [
        "'x' is int32 in A but int64 in B",
        "'y' only in A",
        "'z' only in B",
    ]
    assert schema_differences(a, a, "A", "A") == []
    keyed = pa.schema([("__key__", pa.string()), ("x", pa.int32()), ("y", pa.string())])
    assert schema_differences(a, keyed, "A", "K") == []  # the key column is not a field


def test_table_warning_advises_what_works(tmp_path, caplog):
    _tables(tmp_path / "t", [{"k": [1, 2]}, {"k": [3]}])
    url = str(tmp_path / "t" / "*.parquet")
    with caplog.at_level(logging.WARNING, logger="stallfree.shards.open"):
        open_dataset(url)
    assert "stallfree index" not in caplog.text  # it writes manifests for tar shards only
    assert f"re-shard it once with `stallfree shard {shlex.quote(url)} DST --format arrow`" in caplog.text


def test_the_advised_command_gives_a_dataset_with_a_manifest(tmp_path, capsys):
    from stallfree.cli import main

    _tables(tmp_path / "t", [{"k": [1, 2]}, {"k": [3]}])
    dst = tmp_path / "out"
    assert (
        main(["shard", str(tmp_path / "t" / "*.parquet"), str(dst), "--format", "arrow", "--no-progress"])
        == 0
    )
    assert (dst / "manifest.json").exists()
    assert sorted(s["k"] for s in open_dataset(str(dst))) == [1, 2, 3]
