"""Key-column values no shard may hold (``../x``, ``/abs``, a dot in the last part) are refused at
the table source, so ``on_error`` applies: skip drops and lists those rows, raise names the file
and key. Before, the writer's WriteError ended the run even with ``--on-error skip``."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.errors import ShardError
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source

KEYS = ["a", "../x", "b", "/abs", "dir/c", "d.e"]
GOOD = ["a", "b", "dir/c"]


@pytest.fixture(params=["jsonl", "parquet"])
def table(request, tmp_path):
    if request.param == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps({"key": k, "v": i}) + "\n" for i, k in enumerate(KEYS)))
    else:
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.table({"__key__": KEYS, "v": list(range(len(KEYS)))}), path)
    return path


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_skip_drops_and_lists_unsafe_keys(table, tmp_path, fmt):
    src = open_source(str(table), on_error="skip")
    summary = shard_dataset(src, str(tmp_path / "out"), format=fmt, on_error="skip", shuffle_seed=3)
    ds = open_dataset(str(tmp_path / "out"))
    assert sorted(s["__key__"] for s in ds) == sorted(GOOD)
    lost = sorted(s["error"] for s in summary.skipped)
    assert len(lost) == 3
    for bad in ("../x", "/abs", "d.e"):
        assert sum(repr(bad) in e for e in lost) == 1, lost
    assert all(s["source"].startswith(f"{table}:") for s in summary.skipped)


def test_raise_names_file_and_key(table, tmp_path):
    src = open_source(str(table))
    with pytest.raises(ShardError, match=r"invalid sample key '\.\./x'") as err:
        shard_dataset(src, str(tmp_path / "out"))
    assert str(table) in str(err.value) and err.value.key == "../x"


def test_cli_skip_finishes(table, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "stallfree",
            "shard",
            str(table),
            str(tmp_path / "out"),
            "--on-error",
            "skip",
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples"] == 3
