"""``verify`` over the table layouts ``open_dataset`` reads: Arrow IPC *stream* files (Hugging Face
``save_to_disk``) and Parquet files are checked like our Arrow IPC files (rows counted, keys as the
dataset yields them, size and sha256), and a file in none of those layouts is reported by name.
``scan.resolve`` lists a directory's ``*.parquet`` files the way it lists tars and Arrow files."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.cli import main
from stallfree.errors import MissingShardError
from stallfree.shards.arrow.verify import verify_arrow_shard
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.open import open_dataset
from stallfree.shards.scan import resolve
from stallfree.shards.verify import VerifyReport

datasets = pytest.importorskip("datasets")

N = 29


def _hf_dataset():
    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["a", "b"]),
            "blob": datasets.Value("binary"),
            "emb": datasets.Sequence(datasets.Value("float32")),
        }
    )
    rows = {
        "text": [f"row {i}" for i in range(N)],
        "label": [i % 2 for i in range(N)],
        "blob": [bytes([i]) * (50 + i) for i in range(N)],
        "emb": [[float(i), 0.5] for i in range(N)],
    }
    return datasets.Dataset.from_dict(rows, features=features)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hfverify")
    hf = _hf_dataset()
    hf.save_to_disk(str(root / "disk"), max_shard_size="1KB")  # several stream files
    hf.to_parquet(str(root / "export" / "train-00000-of-00002.parquet"), batch_size=8)
    hf.select(range(10)).to_parquet(str(root / "export" / "train-00001-of-00002.parquet"), batch_size=4)
    (root / "cache").mkdir()  # a ``datasets`` cache file: the stream format too, batches of 5 rows
    hf.map(lambda row: row, writer_batch_size=5, cache_file_name=str(root / "cache" / "cache-map.arrow"))
    return root


def _info(path: Path, rows: int, sha: str | None = None) -> ShardInfo:
    data = path.read_bytes()
    return ShardInfo(path.name, rows, len(data), sha or hashlib.sha256(data).hexdigest())


def _verify_one(path: Path, info: ShardInfo) -> tuple[VerifyReport, list]:
    report = VerifyReport(str(path.parent))
    keys = verify_arrow_shard(fsspec.filesystem("file"), str(path), info, report)
    return report, keys


def _problems(report: VerifyReport) -> list[tuple[str, str | None, str]]:
    return [(p.error, p.shard, p.message) for p in report.problems]


def test_a_stream_file_is_verified_like_an_ipc_file(saved):
    files = sorted((saved / "disk").glob("*.arrow"))
    assert len(files) > 1
    with pa.memory_map(str(files[0])) as f:
        rows = pa.ipc.open_stream(f).read_all().num_rows
    report, keys = _verify_one(files[0], _info(files[0], rows))
    assert _problems(report) == []
    assert report.samples == rows and report.bytes == files[0].stat().st_size
    stem = files[0].stem
    assert keys == [(f"{stem}/{r}", None) for r in range(rows)]


def test_a_stream_with_a_wrong_count_and_hash_is_reported(saved):
    path = sorted((saved / "disk").glob("*.arrow"))[0]
    with pa.memory_map(str(path)) as f:
        rows = pa.ipc.open_stream(f).read_all().num_rows
    report, _ = _verify_one(path, _info(path, rows + 1, sha="0" * 64))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert _problems(report) == [
        ("HashMismatchError", path.name, f"sha256 is {digest}, the manifest says {'0' * 64}"),
        ("IndexMismatchError", path.name, f"manifest says {rows + 1} samples, the Arrow file holds {rows}"),
    ]


def test_a_cache_file_with_many_batches_verifies(saved):
    path = saved / "cache" / "cache-map.arrow"
    report, keys = _verify_one(path, _info(path, N))
    assert _problems(report) == [] and report.samples == N
    assert keys == [(f"cache-map/{r}", None) for r in range(N)]


def test_a_truncated_stream_names_the_file_and_the_last_good_batch(saved, tmp_path):
    src = saved / "cache" / "cache-map.arrow"
    with pa.memory_map(str(src)) as f:
        batches = list(pa.ipc.open_stream(f))
    assert len(batches) == 6  # 29 rows, 5 a batch
    bad = tmp_path / "data-00000-of-00001.arrow"
    bad.write_bytes(src.read_bytes()[:-40])  # the last batch's message is cut short
    report, _ = _verify_one(bad, _info(bad, sum(b.num_rows for b in batches)))
    [(error, shard, message)] = _problems(report)
    assert (error, shard) == ("CorruptShardError", bad.name)
    assert message.startswith(f"Arrow IPC stream unreadable after record batch {len(batches) - 2}: ")


def test_a_file_in_no_table_layout_is_named(tmp_path):
    bad = tmp_path / "notes.arrow"
    bad.write_bytes(b"this is not arrow at all" * 10)
    report, keys = _verify_one(bad, _info(bad, 1))
    [(error, shard, message)] = _problems(report)
    assert (error, shard, keys) == ("CorruptShardError", "notes.arrow", [])
    assert message.startswith("not a readable Arrow IPC file (neither the file nor the stream format): ")
    assert "notes.arrow" in str(report.errors[0])


def test_a_dictionary_encoded_stream_is_refused_as_the_reader_refuses_it(tmp_path):
    path = tmp_path / "dict.arrow"
    table = pa.table({"c": pa.array(["x", "y", "x"]).dictionary_encode()})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    report, _ = _verify_one(path, _info(path, 3))
    assert _problems(report) == [
        (
            "CorruptShardError",
            "dict.arrow",
            "Arrow stream with dictionary-encoded columns: random access is not supported "
            "(rewrite it with `stallfree shard ... --format arrow`)",
        )
    ]


def test_save_to_disk_directory_verifies_clean(saved):
    ds = open_dataset(str(saved / "disk"))
    assert len(ds) == N and ds.verify() == []


def test_cli_verify_save_to_disk_with_a_manifest(saved, tmp_path, capsys):
    """A manifest written for a ``save_to_disk`` directory: ``stallfree verify`` checks its stream
    files (sizes, sample counts) and reports OK."""
    disk = Path(shutil.copytree(saved / "disk", tmp_path / "disk"))
    open_dataset(str(disk)).manifest.save(str(disk))
    assert main(["verify", str(disk), "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["samples"] == N
    assert report["shards"] == len(list(disk.glob("*.arrow")))


def test_cli_verify_names_a_broken_stream(saved, tmp_path, capsys):
    disk = Path(shutil.copytree(saved / "disk", tmp_path / "disk"))
    open_dataset(str(disk)).manifest.save(str(disk))
    victim = sorted(disk.glob("*.arrow"))[1]
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, not Arrow any more
    assert main(["verify", str(disk), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"CorruptShardError: shard {victim.name}: not a readable Arrow IPC file" in out


def test_resolve_lists_parquet_files_of_a_directory(saved, tmp_path):
    export = Path(shutil.copytree(saved / "export", tmp_path / "export"))
    (export / "README.md").write_text("not data")
    (export / "sub").mkdir()
    shutil.copy(export / "train-00001-of-00002.parquet", export / "sub" / "x.parquet")
    fs, root, paths = resolve(str(export))
    assert root == str(export)
    assert paths == [str(export / f"train-0000{i}-of-00002.parquet") for i in range(2)]
    fs, root, paths = resolve(str(export / "train-00001-of-00002.parquet"))
    assert (root, paths) == (str(export), [str(export / "train-00001-of-00002.parquet")])


def test_parquet_directory_opens_and_verifies(saved):
    export = saved / "export"
    ds = open_dataset(str(export))
    theirs = [
        *pq.read_table(export / "train-00000-of-00002.parquet").to_pylist(),
        *pq.read_table(export / "train-00001-of-00002.parquet").to_pylist(),
    ]
    assert len(ds) == N + 10 and ds.format == "arrow"
    for i in (0, N - 1, N, N + 9):
        got = ds[i]
        assert {k: got[k] for k in ("text", "label", "blob")} == {
            k: theirs[i][k] for k in ("text", "label", "blob")
        }
        assert got["emb"].tolist() == theirs[i]["emb"]
    assert ds[N]["__key__"] == "train-00001-of-00002/0"
    assert ds.verify() == []


def test_a_broken_parquet_file_is_named(saved, tmp_path):
    export = Path(shutil.copytree(saved / "export", tmp_path / "export"))
    ds = open_dataset(str(export))  # opened while intact
    victim = export / "train-00001-of-00002.parquet"
    data = bytearray(victim.read_bytes())
    data[-12:-8] = b"\xff\xff\xff\x7f"  # the footer's metadata length: nonsense
    victim.write_bytes(bytes(data))
    errors = ds.verify()
    assert [(type(e).__name__, e.shard) for e in errors] == [("CorruptShardError", victim.name)]
    assert str(errors[0]).startswith("not a readable Parquet file: ")


def test_an_empty_directory_names_every_layout(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "state.json").write_text("{}")
    with pytest.raises(MissingShardError, match=r"no manifest.json and no \.tar, \.arrow or \.parquet files"):
        resolve(str(tmp_path / "empty"))
