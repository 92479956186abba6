import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from stallfree.errors import DuplicateKeyError, WriteError
from stallfree.shards.arrow.writer import ArrowShardWriter


def test_types_kept_small_rows_share_a_batch(tmp_path):
    rows = [
        {
            "__key__": f"r{i}",
            "tokens": np.arange(i, dtype=np.int32),
            "score": i / 2,
            "n": i,
            "text": f"t{i}",
            "raw": bytes([i]) * 3,
        }
        for i in range(4)
    ]
    with ArrowShardWriter(str(tmp_path / "a.arrow")) as w:
        for r in rows:
            w.write(r)
    reader = ipc.open_file(str(tmp_path / "a.arrow"))
    assert reader.num_record_batches == 1  # small rows are grouped (arrow.writer.BATCH_BYTES)
    table = reader.read_all()
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    assert table.schema.field("score").type == pa.float64()
    assert table.schema.field("n").type == pa.int64()
    assert table.schema.field("raw").type == pa.binary()
    assert table.column("__key__").to_pylist() == ["r0", "r1", "r2", "r3"]
    assert table.column("tokens").to_pylist()[3] == [0, 1, 2]
    assert table.column("raw").to_pylist()[2] == b"\x02\x02\x02"
    assert w.info.samples == 4 and w.info.bytes == (tmp_path / "a.arrow").stat().st_size


def test_explicit_schema_and_nulls(tmp_path):
    schema = pa.schema([("label", pa.int16()), ("text", pa.string())])
    with ArrowShardWriter(str(tmp_path / "s.arrow"), schema=schema) as w:
        w.write({"__key__": "a", "label": 3, "text": "x"})
        w.write({"__key__": "b", "label": 4})
    table = ipc.open_file(str(tmp_path / "s.arrow")).read_all()
    assert table.schema.names == ["__key__", "label", "text"]
    assert table.schema.field("label").type == pa.int16()
    assert table.column("text").to_pylist() == ["x", None]


def test_extra_field_and_bad_type(tmp_path):
    with (
        pytest.raises(WriteError, match=r"fields \['new'\] are not in"),
        ArrowShardWriter(str(tmp_path / "e.arrow")) as w,
    ):
        w.write({"__key__": "a", "n": 1})
        w.write({"__key__": "b", "n": 2, "new": 1})
    with (
        pytest.raises(WriteError, match="does not fit") as info,
        ArrowShardWriter(str(tmp_path / "t.arrow")) as w,
    ):
        w.write({"__key__": "a", "n": 1})
        w.write({"__key__": "b", "n": "text"})
    assert info.value.key == "b"
    with pytest.raises(WriteError, match="1-D"), ArrowShardWriter(str(tmp_path / "m.arrow")) as w:
        w.write({"__key__": "a", "img": np.zeros((2, 2))})
    assert list(tmp_path.iterdir()) == []


def test_duplicate_key(tmp_path):
    with pytest.raises(DuplicateKeyError) as info, ArrowShardWriter(str(tmp_path / "d.arrow")) as w:
        w.write({"__key__": "a", "n": 1})
        w.write({"__key__": "a", "n": 2})
    assert (info.value.key, info.value.shard) == ("a", "d.arrow")
    assert list(tmp_path.iterdir()) == []
