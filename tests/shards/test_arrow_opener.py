"""One opener of "an Arrow IPC file, an IPC stream or a Parquet file" (``arrow.reader.open_batches``),
used by the shard reader, ``verify``, the table source of ``stallfree shard`` and the token
reader. The layout is read off the file, never found by trying ``open_file`` first: a failed
``open_file`` on a memory map left its read on pyarrow's IO threads (the token reader's flaky
``test_cut_short``), and three of the four openers did exactly that for every stream."""

from __future__ import annotations

import ast
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from stallfree.shards.arrow.reader import ArrowShardReader
from stallfree.shards.arrow.verify import verify_arrow_shard
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.sources.registry import open_source
from stallfree.shards.verify import VerifyReport
from stallfree.tokens.arrow_tokens import ArrowTokenSource

PACKAGE = Path(__file__).resolve().parents[2] / "stallfree"
OPENER = "stallfree/shards/arrow/reader.py"
DOCS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]


def _table() -> pa.Table:
    ids = pa.array(DOCS, type=pa.list_(pa.int32()))
    return pa.table({"__key__": [f"d{i}" for i in range(len(DOCS))], "input_ids": ids})


@pytest.fixture
def layouts(tmp_path) -> dict[str, Path]:
    table = _table()
    stream, ipc_file, parquet = tmp_path / "stream.arrow", tmp_path / "file.arrow", tmp_path / "t.parquet"
    with pa.ipc.new_stream(str(stream), table.schema) as w:
        w.write_table(table, max_chunksize=2)
    with pa.ipc.new_file(str(ipc_file), table.schema) as w:
        w.write_table(table, max_chunksize=2)
    pq.write_table(table, str(parquet), row_group_size=2)
    return {"stream": stream, "file": ipc_file, "parquet": parquet}


@pytest.fixture
def open_file_calls(monkeypatch) -> list[str]:
    """Every ``pyarrow.ipc.open_file`` call, by the first bytes of what it was asked to open."""
    calls: list[str] = []
    real = pyarrow.ipc.open_file

    def spy(source, *args, **kwargs):
        head = source.read_at(6, 0) if hasattr(source, "read_at") else b"?"
        calls.append("file" if head == b"ARROW1" else "not a file")
        return real(source, *args, **kwargs)

    monkeypatch.setattr(pyarrow.ipc, "open_file", spy)
    return calls


def _rows(reader: ArrowShardReader) -> list[tuple[str, list[int]]]:
    return [(r["__key__"], list(r["input_ids"])) for r in reader.iter_rows()]


EXPECTED = [(f"d{i}", doc) for i, doc in enumerate(DOCS)]


@pytest.mark.parametrize("layout", ["stream", "file", "parquet"])
def test_every_reader_opens_each_layout_without_trying_open_file_on_a_stream(
    layouts, open_file_calls, layout
):
    path = layouts[layout]
    fs = fsspec.filesystem("file")
    reader = ArrowShardReader(fs, str(path), path.name)
    try:
        assert _rows(reader) == EXPECTED
    finally:
        reader.close()
    report = VerifyReport(str(path.parent))
    info = ShardInfo(path.name, len(DOCS), path.stat().st_size, None)
    keys = verify_arrow_shard(fs, str(path), info, report)
    assert report.errors == [] and [k for k, _ in keys] == [k for k, _ in EXPECTED]
    source = open_source(str(path))
    assert [s["__key__"] for s in source.read_many(source.items())] == [k for k, _ in EXPECTED]
    tokens = ArrowTokenSource(str(path))
    flat = [t for doc in DOCS for t in doc]
    assert tokens.doc_lengths.tolist() == [len(d) for d in DOCS]
    assert tokens.read(0, len(flat)).tolist() == flat
    assert open_file_calls == ([] if layout != "file" else ["file"] * len(open_file_calls))


def test_one_module_opens_arrow_files_and_streams():
    """``grep`` for the opener: only ``arrow/reader.py`` calls pyarrow's IPC openers."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("open_file", "open_stream"):
                found.append(str(path.relative_to(PACKAGE.parent)))
    assert set(found) == {OPENER}
