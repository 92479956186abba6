"""An engine's Arrow batches written as Arrow shards without Python values per row
(``arrow/engine_rows.py``, taken by ``write_engines.write_partition``) give the bytes the row by
row path gives (``ShardWriter.write`` of ``samples_of``'s samples): the same shards, roll-over,
record batches and manifest part, for small and large rows, nulls, keys from ``__key__``, from
``key`` and made, engine batches of any size, bad keys raised or skipped, duplicate keys and
batches whose schema changes half-way (Ray blocks)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from stallfree.errors import DuplicateKeyError
from stallfree.shards import open_dataset
from stallfree.shards.sources.registry import SourceReadError
from stallfree.shards.write_engines import PartitionPart, PartitionWrite, write_partition

PARTITION = 3


def row_by_row(spec: PartitionWrite, batches: list[Any], schema: pa.Schema) -> PartitionPart:
    """The reference: every row a sample through ``ShardWriter.write``."""
    return write_partition(spec, PARTITION, batches, schema, arrow_rows=False)


def tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def both(tmp_path: Path, batches: list[Any], schema: pa.Schema | None = None, **limits: Any):
    """Write ``batches`` both ways; return (ours, reference) parts after checking the bytes agree."""
    schema = schema if schema is not None else batches[0].schema
    (tmp_path / "ours").mkdir()
    (tmp_path / "ref").mkdir()
    ours = write_partition(
        PartitionWrite(str(tmp_path / "ours"), {}, "arrow", **limits), PARTITION, batches, schema
    )
    ref = row_by_row(PartitionWrite(str(tmp_path / "ref"), {}, "arrow", **limits), batches, schema)
    assert tree(tmp_path / "ours") == tree(tmp_path / "ref")
    assert ours.dumps() == ref.dumps()
    return ours, ref


def table(
    n: int, seed: int, *, nulls: float = 0.0, caption: int = 100, blob: int = 64, key: str | None = None
):
    rnd = random.Random(seed)

    def maybe(value):
        return None if nulls and rnd.random() < nulls else value

    columns: dict[str, Any] = {}
    if key == "__key__":
        columns["__key__"] = pa.array([maybe(f"s/{seed}-{i}") for i in range(n)], pa.string())
    columns["id"] = pa.array([maybe(i * 7 - 50) for i in range(n)], pa.int64())
    columns["caption"] = pa.array(
        [maybe("é" * (i % 3) + "x" * rnd.randint(0, caption)) for i in range(n)], pa.string()
    )
    columns["emb"] = pa.array([maybe(rnd.randbytes(rnd.randint(0, blob))) for i in range(n)], pa.binary())
    columns["score"] = pa.array([maybe(rnd.random()) for _ in range(n)], pa.float32())
    columns["flag"] = pa.array([maybe(i % 3 == 0) for i in range(n)], pa.bool_())
    if key == "key":
        columns["key"] = pa.array([maybe(i * 10) for i in range(n)], pa.int32())
    return pa.table(columns)


def chunks(t: pa.Table, seed: int) -> list[pa.RecordBatch]:
    """The table cut into engine batches of random sizes."""
    rnd = random.Random(seed)
    out, at = [], 0
    while at < t.num_rows:
        size = rnd.choice([1, 7, 300, 1500, 10_000])
        out.extend(t.slice(at, size).to_batches())
        at += size
    return out


@pytest.mark.parametrize(
    "n, limits, shape",
    [
        (6000, {}, {}),  # one shard of small rows (the benchmark's kind)
        (5000, {"max_samples": 777}, {"nulls": 0.2}),
        (4000, {"max_bytes": 90_000}, {"key": "__key__", "nulls": 0.1}),
        (3000, {"max_bytes": 200_000, "max_samples": 1100}, {"key": "key", "nulls": 0.3}),
        (400, {"max_bytes": 300_000}, {"caption": 3000, "blob": 40_000}),  # rows near BATCH_BYTES
        (60, {"max_bytes": 150_000}, {"blob": 140_000}),  # rows of their own batch, shards of one
    ],
)
def test_arrow_rows_are_byte_identical_to_row_by_row(tmp_path, n, limits, shape):
    t = table(n, seed=n, **shape)
    ours, _ = both(tmp_path, chunks(t, seed=n), **limits)
    assert ours.manifest is not None and ours.manifest.samples == n
    if limits:
        assert len(ours.manifest.shards) >= 2


def test_nulls_keep_no_bytes_an_engine_left_under_them(tmp_path):
    """An engine may leave any bytes under a null slot; a Python null writes zeros there."""
    import numpy as np

    data = np.array([1, 77, 3, 99], np.int64)
    ids = pa.Array.from_buffers(pa.int64(), 4, [pa.py_buffer(bytes([0b0101])), pa.py_buffer(data.tobytes())])
    text = pa.Array.from_buffers(
        pa.string(), 4, [pa.py_buffer(bytes([0b0101])), pa.py_buffer(np.array([0, 1, 3, 4, 6], np.int32).tobytes()), pa.py_buffer(b"abcdef")]
    )  # fmt: skip
    batch = pa.RecordBatch.from_arrays([ids, text], names=["id", "text"])
    both(tmp_path, [batch])
    assert [s.get("id") for s in open_dataset(str(tmp_path / "ours"))] == [1, None, 3, None]


def test_made_keys_and_then_column_keys(tmp_path):
    """Keys made from partition and row where ``__key__`` is null; read back in order."""
    batch = pa.RecordBatch.from_pydict({"__key__": ["a", None, "c", None], "v": [1, 2, 3, 4]})
    both(tmp_path, [batch, batch.slice(1, 1)], max_samples=2)  # the second batch's null: row 4
    keys = [s["__key__"] for s in open_dataset(str(tmp_path / "ours"))]
    assert keys == ["a", "00003-000000001", "c", "00003-000000003", "00003-000000004"]


def test_bad_keys_are_skipped_or_raised_naming_partition_row_and_key(tmp_path):
    keys = ["ok1", "../up", "x.jpg", "sp ace", "ünï", "d/e", "/abs", "fine/"]
    batch = pa.RecordBatch.from_pydict({"__key__": keys, "v": list(range(len(keys)))})
    (tmp_path / "skip").mkdir()
    ours, _ = both(tmp_path / "skip", [batch], on_error="skip")
    assert [s["key"] for s in ours.skipped] == ["../up", "x.jpg", "sp ace", "/abs", "fine/"]
    assert ours.skipped[0] == {
        "source": "partition 3",
        "error": ours.skipped[0]["error"],
        "key": "../up",
    } and ours.skipped[0]["error"].startswith("row 1: invalid sample key '../up'")
    assert [s["__key__"] for s in open_dataset(str(tmp_path / "skip" / "ours"))] == ["ok1", "ünï", "d/e"]
    errors = [str(e) for e in raised(tmp_path, [batch], SourceReadError)]
    assert errors[0] == errors[1] and "row 1: invalid sample key '../up'" in errors[0]
    assert "partition 3" in errors[0]


def raised(tmp_path: Path, batches: list[Any], error: type[Exception]) -> list[Exception]:
    """The error each way raises; neither leaves a file (the shard in progress is removed)."""
    errors = []
    for way, write in (("ours", write_partition), ("ref", None)):
        (tmp_path / way).mkdir()
        spec = PartitionWrite(str(tmp_path / way), {}, "arrow")
        with pytest.raises(error) as caught:
            if write is None:
                row_by_row(spec, batches, batches[0].schema)
            else:
                write(spec, PARTITION, batches, batches[0].schema)
        errors.append(caught.value)
        assert list((tmp_path / way).iterdir()) == []
    return errors


@pytest.mark.parametrize("then_bad_key", [False, True])
def test_a_duplicate_key_names_shard_key_and_offset_as_row_by_row(tmp_path, then_bad_key):
    keys = [f"k{i}" for i in range(2000)]
    keys[1500] = "k20"  # an earlier row's key, in a later record batch of the same shard
    if then_bad_key:
        keys[1800] = "../later"  # met after the duplicate: the duplicate is still the error
    batch = pa.RecordBatch.from_pydict({"__key__": keys, "text": ["t" * 90] * 2000})
    errors = [(str(e), e.key, e.offset, e.shard) for e in raised(tmp_path, [batch], DuplicateKeyError)]
    assert errors[0] == errors[1]
    assert errors[0][1] == "k20" and errors[0][3] == "part-00003-0000.arrow" and errors[0][2] > 0


def test_a_batch_of_another_schema_goes_row_by_row_into_the_same_shards(tmp_path):
    """Ray blocks may differ (a column all null in one block is of type null there)."""
    first = pa.RecordBatch.from_pydict({"id": pa.array(range(500), pa.int64()), "t": ["x" * 50] * 500})
    other = pa.RecordBatch.from_pydict({"id": pa.array(range(500, 700), pa.int32()), "t": ["y" * 30] * 200})
    both(tmp_path, [first, other, first.slice(0, 100)], schema=first.schema, max_bytes=60_000)


def test_tables_and_empty_batches(tmp_path):
    t = table(900, seed=9)
    both(
        tmp_path,
        [t.slice(0, 0), t.slice(0, 400), t.slice(400, 0), t.slice(400)],
        schema=t.schema,
        max_samples=300,
    )


@pytest.mark.parametrize("spare", [0, -1])
def test_the_row_that_closes_the_first_batch_is_checked_for_roll_over_once(tmp_path, spare):
    """Row 3 does not fit the first record batch (3 x 20 KB written, 64 KiB); ``ShardWriter``
    checks it against ``max_bytes`` before that batch is written, not after: at the exact
    boundary it joins the shard, one byte less and it starts the next."""
    from stallfree.shards.arrow.writer import ArrowShardWriter

    rows = [{"__key__": f"k{i}", "blob": bytes([i]) * 20_000} for i in range(6)]
    before = sum(len(r["__key__"]) + 20_000 for r in rows[:3])
    max_bytes = before + ArrowShardWriter.estimate(rows[3]) + 1024 + spare
    batch = pa.RecordBatch.from_pylist(rows)
    ours, _ = both(tmp_path, [batch], max_bytes=max_bytes)
    assert ours.manifest.shards[0].samples == (4 if spare == 0 else 3)
