"""Arrow shards group small rows into record batches (``arrow.writer.BATCH_BYTES`` of row data,
``BATCH_ROWS`` rows at most); a row of ``BATCH_BYTES`` or more is a batch of its own. Before,
every row was a batch: a 100-byte row took ~535 bytes on disk. Random access still reads one
batch, locally (memory map) and over HTTP (ranged reads), and serves every row exactly."""

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from stallfree.errors import WriteError
from stallfree.shards.arrow.writer import BATCH_BYTES, BATCH_ROWS, ROWS_PER_BATCH, ArrowShardWriter
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.httpserve import serve_directory

ROWS = 10_000


def _small_rows() -> list[dict]:
    # key (6 bytes) + data (94 bytes): 100 bytes of row data each, as the batching rule counts
    return [{"__key__": f"k{i:05d}", "data": bytes([i % 251]) * 94} for i in range(ROWS)]


def _batch_rows(path) -> list[int]:
    reader = ipc.open_file(str(path))
    return [reader.get_batch(b).num_rows for b in range(reader.num_record_batches)]


def test_small_rows_share_batches_and_bytes_per_row_fall(tmp_path):
    rows = _small_rows()
    with ShardWriter(str(tmp_path / "ds"), format="arrow") as w:
        for r in rows:
            w.write(r)
    [shard] = w.manifest.shards
    path = tmp_path / "ds" / shard.path
    per_batch = BATCH_BYTES // 100  # 655 rows fill 65,500 bytes; the 656th would pass 64 KiB
    assert _batch_rows(path) == [per_batch] * (ROWS // per_batch) + [ROWS % per_batch]
    assert len(_batch_rows(path)) == 16
    # 100 bytes of data + offsets (8) + a share of one batch's metadata: not ~535 as before
    assert shard.bytes / ROWS < 115
    table = ipc.open_file(str(path)).read_all()
    assert table.to_pylist() == rows


def test_the_first_batch_sets_every_batchs_count(tmp_path):
    """Tiny rows stop the first batch at ``BATCH_ROWS``; every later batch holds that many rows,
    whatever their sizes (the last one fewer), and the count is in the schema for readers."""
    tiny = [{"__key__": f"t{i:04d}", "n": i, "blob": b""} for i in range(BATCH_ROWS + 5)]
    big = {"__key__": "big", "n": -1, "blob": b"x" * BATCH_BYTES}
    after = [{"__key__": f"u{i}", "n": i, "blob": b"y"} for i in range(3)]
    with ArrowShardWriter(str(tmp_path / "a.arrow")) as w:
        for r in tiny:
            w.write(r)
        w.write(big)
        for r in after:
            w.write(r)
    assert _batch_rows(tmp_path / "a.arrow") == [BATCH_ROWS, 9]
    f = ipc.open_file(str(tmp_path / "a.arrow"))
    assert f.schema.metadata[ROWS_PER_BATCH] == str(BATCH_ROWS).encode()
    keys = f.read_all().column("__key__").to_pylist()
    assert keys == [r["__key__"] for r in [*tiny, big, *after]]


def test_a_big_first_row_keeps_one_row_per_batch(tmp_path):
    """A first row of ``BATCH_BYTES`` or more is a batch of its own, and so is every row after it:
    image and document shards keep the one-row-per-batch layout and its read cost."""
    rows = [{"__key__": "big", "blob": b"x" * BATCH_BYTES}] + [
        {"__key__": f"s{i}", "blob": b"y" * (10 + i)} for i in range(4)
    ]
    with ArrowShardWriter(str(tmp_path / "b.arrow")) as w:
        for r in rows:
            w.write(r)
    assert _batch_rows(tmp_path / "b.arrow") == [1, 1, 1, 1, 1]


def test_a_remote_open_reads_the_footer_and_one_batch_not_every_batch(tmp_path):
    """Opening a served shard of many small-row batches reads its footer and its last batch (the
    count check), not every batch: the schema says how many rows each holds."""
    from fsspec.implementations.http import HTTPFileSystem

    from stallfree.shards.arrow.reader import ArrowShardReader

    rows = [{"__key__": f"r{i:05d}", "n": i, "text": "z" * 100} for i in range(20_000)]
    with ArrowShardWriter(str(tmp_path / "c.arrow")) as w:
        for r in rows:
            w.write(r)
    info = w.info
    assert len(_batch_rows(tmp_path / "c.arrow")) > 20
    with serve_directory(tmp_path) as server:
        fs = HTTPFileSystem(skip_instance_cache=True)
        server.stats.reset()
        reader = ArrowShardReader(fs, f"{server.url}/c.arrow", "c.arrow", info)
        opened = server.stats.bytes_sent
        assert len(reader) == 20_000
        for i in (0, 654, 655, 19_999, 7_777):
            assert reader.get(i)["__key__"] == f"r{i:05d}"
        reader.close()
    assert opened < info.bytes // 4  # reading every batch at open sent the whole file


def _mixed_rows() -> list[dict]:
    """Rows of every size class: tiny, mid-sized (several to a batch), bigger than a batch;
    typed columns (a numeric list, nulls) so conversion by column is checked too."""
    rows = []
    for i in range(300):
        size = (7, 5_000, 70_000)[i % 3] + i
        rows.append(
            {
                "__key__": f"m{i:04d}",
                "blob": bytes([(i * 13) % 256]) * size,
                "tokens": np.arange(i % 17, dtype=np.int32) + i,
                "score": None if i % 5 == 4 else i / 4,
                "text": f"row {i}",
            }
        )
    return rows


def _same(got: dict, want: dict) -> None:
    assert got["__key__"] == want["__key__"]
    assert got["blob"] == want["blob"] and got["text"] == want["text"]
    assert got.get("score") == want["score"]
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    assert got["tokens"].dtype == np.int32


@pytest.mark.parametrize("where", ["local", "http"])
def test_random_access_over_every_row_equals_the_input(tmp_path, where):
    rows = _mixed_rows()
    with ShardWriter(str(tmp_path / "ds"), format="arrow", max_bytes=4_000_000) as w:
        for r in rows:
            w.write(r)
    shards = w.manifest.shards
    assert len(shards) > 1  # rows reach across shard boundaries too
    batches = [len(_batch_rows(tmp_path / "ds" / s.path)) for s in shards]
    assert sum(batches) < len(rows)  # small rows share batches
    order = list(np.random.default_rng(3).permutation(len(rows)))
    if where == "local":
        ds = open_dataset(str(tmp_path / "ds"))
        got = [ds[int(i)] for i in order]
    else:
        with serve_directory(tmp_path) as server:
            ds = open_dataset(f"{server.url}/ds")
            got = [ds[int(i)] for i in order]
    for i, sample in zip(order, got, strict=True):
        _same(sample, rows[i])


def test_a_bad_value_is_named_when_its_batch_is_written(tmp_path):
    """Conversion is by column, at the batch's end: the error still names the row's key and
    field, and the shard is not left behind."""
    with (
        pytest.raises(WriteError, match="does not fit") as info,
        ArrowShardWriter(str(tmp_path / "b.arrow")) as w,
    ):
        for i in range(5):
            w.write({"__key__": f"r{i}", "n": "text" if i == 3 else i})
    assert (info.value.key, info.value.shard) == ("r3", "b.arrow")
    assert "'n'" in str(info.value)
    with (
        pytest.raises(WriteError, match="does not fit") as info,
        ArrowShardWriter(str(tmp_path / "l.arrow")) as w,
    ):
        w.write({"__key__": "a", "v": np.arange(3, dtype=np.int32)})
        w.write({"__key__": "b", "v": np.array([0.5, 1.0])})  # truncating cast: refused, as alone
    assert info.value.key == "b"
    assert list(tmp_path.iterdir()) == []


def test_schema_typed_list_column_and_nulls(tmp_path):
    schema = pa.schema([("v", pa.list_(pa.int16())), ("s", pa.string())])
    rows = [
        {"__key__": "a", "v": np.array([1, 2], dtype=np.int64), "s": "x"},
        {"__key__": "b", "s": "y"},
        {"__key__": "c", "v": np.array([], dtype=np.int64)},
    ]
    with ArrowShardWriter(str(tmp_path / "s.arrow"), schema=schema) as w:
        for r in rows:
            w.write(r)
    table = ipc.open_file(str(tmp_path / "s.arrow")).read_all()
    assert table.schema.field("v").type == pa.list_(pa.int16())
    assert table.column("v").to_pylist() == [[1, 2], None, []]
    assert table.column("s").to_pylist() == ["x", "y", None]
