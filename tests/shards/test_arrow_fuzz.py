"""Damaged Arrow files never crash the interpreter (issue 36 item 5).

pyarrow trusts a record batch's offsets; before ``arrow_check`` a flipped bit in a shard killed
the process (SIGSEGV, SIGBUS, SIGABRT ``std::length_error``) from ``ds[i]``, from the loader,
and from ``stallfree shard`` of a damaged Hugging Face ``.arrow``. Here a seeded fuzz (bit flips,
truncations, overwritten lengths and offsets) runs over a small Arrow shard and a Hugging Face
style ``.arrow`` stream, many cases per child process (``arrow_fuzz_child.py``) so a crash fails
the test naming its case. Every outcome must be the original rows, or a typed error naming the
file; a row that reads back different must have had its own bytes damaged (nothing structural
can tell such bytes from data: the manifest's sha256, ``verify_hashes=True``, does, and is
checked too). Then the loader, with workers and ``on_error="skip"``, skips a damaged batch,
counts it, and delivers the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from stallfree.shards.arrow.check import footer_span, ipc_file_blocks
from stallfree.shards.writer import ShardWriter
from tests.zygote import run_python

from .conftest import make_samples

CHILD = Path(__file__).with_name("arrow_fuzz_child.py")
SEED = 36_5
ROWS = 12
HF_BATCH = 4  # rows per record batch of the Hugging Face style stream
PER_CHILD = 120


def _samples() -> list[dict[str, Any]]:
    out = make_samples(ROWS, size=48)
    for i, s in enumerate(out):
        s["emb"] = np.arange(i % 4, dtype=np.float32)
    return out


@pytest.fixture
def shard_dir(tmp_path, monkeypatch) -> Path:
    # one row per record batch (as a shard of big samples is laid out), so the damage tests can
    # hit batch 5 = row 5; multi-row batches are fuzzed through the Hugging Face stream below
    monkeypatch.setattr("stallfree.shards.arrow.writer.BATCH_ROWS", 1)
    root = tmp_path / "ds"
    with ShardWriter(str(root), format="arrow", max_samples=ROWS) as w:
        for s in _samples():
            w.write(s)
    return root


HF_FEATURES = {
    "image": {"_type": "Image"},
    "label": {"names": ["car", "cat", "dog"], "_type": "ClassLabel"},
    "caption": {"dtype": "string", "_type": "Value"},
}


def write_hf_stream(path: Path) -> None:
    """What ``datasets`` writes under ``.arrow``: the IPC *stream* format, features in the
    schema's ``huggingface`` metadata, ``Image()`` cells as ``{bytes, path}`` structs."""
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    meta = {b"huggingface": json.dumps({"info": {"features": HF_FEATURES}}).encode()}
    schema = pa.schema([("image", image), ("label", pa.int64()), ("caption", pa.string())], metadata=meta)
    rows = [
        {
            "image": {"bytes": bytes([i]) * (20 + i), "path": f"img{i}.jpg"},
            "label": i % 3,
            "caption": f"row {i}",
        }
        for i in range(ROWS)
    ]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for start in range(0, ROWS, HF_BATCH):
            writer.write_batch(pa.RecordBatch.from_pylist(rows[start : start + HF_BATCH], schema=schema))


def stream_spans(data: bytes) -> tuple[int, list[tuple[int, int]]]:
    """(end of the schema message, each batch's [start, end) bytes) of an IPC stream."""
    source = pa.BufferReader(data)
    reader = pa.ipc.open_stream(source)
    spans, start = [], source.tell()
    schema_end = start
    for _ in reader:
        spans.append((start, source.tell()))
        start = source.tell()
    return schema_end, spans


def run_cases(spec: dict[str, Any], total: int) -> list[dict[str, Any]]:
    """Every case's result, ``PER_CHILD`` cases a child; a child that dies fails the test with
    the case it was on (and how that case damaged the file)."""
    results = []
    for first in range(0, total, PER_CHILD):
        args = json.dumps({**spec, "first": first, "count": min(PER_CHILD, total - first)})
        proc = subprocess.run([sys.executable, str(CHILD), args], capture_output=True, text=True, timeout=120)
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0:
            started = [x for x in lines if "start" in x]
            last = started[-1] if started else None
            pytest.fail(
                f"the child died (rc {proc.returncode}) on seed {SEED} {spec['target']} case "
                f"{last and last['case']} ({last and last['start']}):\n{proc.stderr[-3000:]}"
            )
        results += [x for x in lines if "outcome" in x or "read" in x]
    assert len(results) == total
    return results


def explained(
    rows: list[int], lo: int, hi: int, spans: list[tuple[int, int]], shared: tuple[int, int]
) -> list[int]:
    """The changed rows the damage cannot explain: damage inside a row's own batch, or inside
    what every row shares (the schema), may change it without any check noticing."""
    hit = lambda a, b: lo < b and a < hi  # noqa: E731
    if hit(*shared):
        return []
    return [r for r in rows if not hit(*spans[r])]


def test_fuzzed_arrow_shard_reads_correct_rows_or_typed_errors(shard_dir, tmp_path):
    name = "shard-000000.arrow"
    original = (shard_dir / name).read_bytes()
    keep = tmp_path / name
    keep.write_bytes(original)
    start, length = footer_span(len(original), original[-64:], name)
    blocks = ipc_file_blocks(len(original), original[start : start + length], start, original[:8], name)
    spans = list(zip(blocks.offsets.tolist(), blocks.ends.tolist(), strict=True))
    spec = {"target": "shard", "original": str(keep), "work": str(shard_dir), "seed": SEED}
    results = run_cases(spec, 240)
    changed_cases = 0
    for r in results:
        read = r["read"]
        where = f"case {r['case']} ({r['what']})"
        assert read["bad"] == [], f"{where}: untyped error or one not naming the shard: {read['bad']}"
        assert read["changed_like"] == [], f"{where}: rows served as other rows {read['changed_like']}"
        assert read["equal"] + read["typed"] + len(read["changed"]) == ROWS, where
        unexplained = explained(read["changed"], r["lo"], r["hi"], spans, (start, len(original)))
        assert unexplained == [], f"{where}: rows {unexplained} changed by damage outside their batch"
        if read["changed"]:
            changed_cases += 1
            assert r["hashed"]["typed"] == ROWS, f"{where}: verify_hashes=True let damage through"
    outcomes = [(r["read"]["typed"] > 0, r["read"]["equal"] == ROWS) for r in results]
    assert sum(t for t, _ in outcomes) > 100  # the fuzz does reach the checks
    assert (shard_dir / name).read_bytes() == original  # the child put the shard back


def test_fuzzed_hf_arrow_stream_reads_correct_rows_or_typed_errors(tmp_path):
    original_path = tmp_path / "data-00000-of-00001.arrow"
    write_hf_stream(original_path)
    original = original_path.read_bytes()
    schema_end, spans = stream_spans(original)
    row_spans = [spans[r // HF_BATCH] for r in range(ROWS)]
    work = tmp_path / "work"
    work.mkdir()
    spec = {"target": "hf", "original": str(original_path), "work": str(work), "seed": SEED}
    results = run_cases(spec, 180)
    for r in results:
        where = f"case {r['case']} ({r['what']})"
        for how in ("read", "source"):
            got = r[how]
            assert got["bad"] == [], (
                f"{where} via {how}: untyped error or one not naming the file: {got['bad']}"
            )
            assert got["changed_like"] == [], f"{where} via {how}: rows served as other rows"
            rows = [int(str(k).rsplit("/", 1)[-1]) for k in got["changed"]]
            unexplained = explained(rows, r["lo"], r["hi"], row_spans, (0, schema_end))
            assert unexplained == [], (
                f"{where} via {how}: rows {unexplained} changed by damage outside their batch"
            )
    assert sum(r["read"]["typed"] > 0 for r in results) > 60


def _damage_batch(path: Path, batch: int) -> int:
    """Point batch ``batch``'s binary column's end offset far past its data (what crashed
    ``as_py``); returns that batch's byte offset."""
    data = bytearray(path.read_bytes())
    start, length = footer_span(len(data), bytes(data[-64:]), path.name)
    blocks = ipc_file_blocks(
        len(data), bytes(data[start : start + length]), start, bytes(data[:8]), path.name
    )
    lo, hi = int(blocks.offsets[batch]), int(blocks.ends[batch])
    import pyarrow.ipc as ipc

    reader = ipc.open_file(pa.BufferReader(bytes(data)))
    body = reader.get_batch(batch)
    jpg = body.column("jpg")
    offsets = jpg.buffers()[1]
    n = len(jpg.buffers()[2].to_pybytes())
    meta = int.from_bytes(data[lo + 4 : lo + 8], "little")  # after the 0xFFFFFFFF marker
    needle = (0).to_bytes(4, "little") + n.to_bytes(4, "little")
    at = bytes(data).find(needle, lo + 8 + meta, hi)  # in the body: the offsets buffer
    assert at > 0 and offsets.size >= 8
    data[at + 4 : at + 8] = (0x7FFFFFF0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return lo


READ_CHILD = """
import json, sys
from stallfree.errors import CorruptShardError
from stallfree.shards.open import open_dataset
ds = open_dataset(sys.argv[1])
try:
    ds[5]
    error = None
except CorruptShardError as exc:
    error = {"shard": exc.shard, "offset": exc.offset, "message": str(exc)}
print(json.dumps({"error": error, "around": [ds[i]["__key__"] for i in (4, 6)], "key": ds.key_of(5)}))
"""


def run_child(code: str, *args: str) -> dict[str, Any]:
    """``code`` in a fresh interpreter (a crash fails the test, not the run); its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_loader_child(code: str, *args: str) -> dict[str, Any]:
    """``run_child`` for a child that imports torch (the loader's): forked from the test zygote,
    torch imported once, with the fault handler on as PYTHONFAULTHANDLER=1 would turn it on
    (a variable read at start-up: set, it would need a zygote of its own)."""
    proc = run_python(f"import faulthandler\nfaulthandler.enable()\n{code}", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_damaged_batch_is_a_typed_error_naming_shard_row_and_offset(shard_dir):
    name = "shard-000000.arrow"
    offset = _damage_batch(shard_dir / name, 5)
    out = run_child(READ_CHILD, str(shard_dir))
    assert out["error"] is not None, "the damaged row read back"
    assert (out["error"]["shard"], out["error"]["offset"]) == (name, offset)
    assert "record batch 5 (row 5) is damaged" in out["error"]["message"]
    assert out["around"] == ["sample00004", "sample00006"]
    assert out["key"] is None  # its key column cannot be trusted to name it


LOADER_CHILD = """
import json, sys
from stallfree import DataLoader
from stallfree.shards.open import open_dataset
out = {}
for workers in (0, 2):
    ds = open_dataset(sys.argv[1])
    loader = DataLoader(ds, batch_size=4, num_workers=workers, on_error="skip", collate_fn=list, shuffle=False)
    keys = sorted(s["__key__"] for batch in loader for s in batch)
    stats = loader.stats()
    out[workers] = {"keys": keys, "failed": stats["failures"], "failed_keys": stats["failed_keys"]}
print(json.dumps(out))
"""


def test_loader_skips_the_damaged_batch_and_delivers_the_rest(shard_dir):
    """With 0 workers (a thread) and with 2 worker processes (it was a WorkerDiedError that
    ``on_error="skip"`` could not skip, or the interpreter killed)."""
    _damage_batch(shard_dir / "shard-000000.arrow", 5)
    out = run_loader_child(LOADER_CHILD, str(shard_dir))
    for workers in ("0", "2"):
        assert out[workers]["keys"] == [f"sample{i:05d}" for i in range(ROWS) if i != 5], workers
        assert out[workers]["failed"] == 1 and out[workers]["failed_keys"] == ["index 5"], workers


REMOTE_CHILD = """
import json, sys
from stallfree.errors import CorruptShardError
from stallfree.shards.open import open_dataset
ds = open_dataset(sys.argv[1])
out = {"keys": [], "errors": []}
for i in range(len(ds)):
    try:
        out["keys"].append(ds[i]["__key__"])
    except CorruptShardError as exc:
        out["errors"].append({"index": i, "shard": exc.shard, "offset": exc.offset, "message": str(exc)})
print(json.dumps(out))
"""


def test_remote_damaged_batch_is_a_typed_error_too(shard_dir):
    """The same damage read over HTTP (``remote.RangeFile``; the footer read once, then batch by
    batch): batch 5 is a typed error naming shard, row and byte offset; the rest read."""
    from stallfree.testing.httpserve import serve_directory

    name = "shard-000000.arrow"
    offset = _damage_batch(shard_dir / name, 5)
    with serve_directory(shard_dir.parent) as server:
        out = run_child(REMOTE_CHILD, f"{server.url}/{shard_dir.name}")
    assert out["keys"] == [f"sample{i:05d}" for i in range(ROWS) if i != 5]
    [error] = out["errors"]
    assert (error["index"], error["shard"], error["offset"]) == (5, name, offset)
    assert "record batch 5 (row 5) is damaged" in error["message"]


SHARD_CHILD = """
import json, sys
from stallfree.cli import main
rc = main(["shard", sys.argv[1], sys.argv[2], "--on-error", sys.argv[3], "--no-progress"])
out = {"rc": rc}
if rc == 0:
    from stallfree.shards.open import open_dataset
    ds = open_dataset(sys.argv[2])
    out["keys"] = sorted(s["__key__"] for s in ds)
    out["skipped"] = ds.manifest.skipped
print(json.dumps(out))
"""


def _damage_hf_batch(path: Path, batch: int) -> int:
    """Point a caption offset of stream batch ``batch`` (rows 4k..4k+3) past its data; returns
    the batch's byte offset."""
    data = bytearray(path.read_bytes())
    _, spans = stream_spans(bytes(data))
    lo, hi = spans[batch]
    lengths = [len(f"row {r}") for r in range(batch * HF_BATCH, (batch + 1) * HF_BATCH)]
    ends = np.cumsum([0, *lengths]).astype("<i4")
    at = bytes(data).find(ends.tobytes(), lo, hi)
    assert at > 0
    data[at + 8 : at + 12] = (0x7FFFFFF0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return lo


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_shard_of_a_damaged_hf_arrow_skips_or_names_the_batch(tmp_path, on_error, capsys):
    """``stallfree shard`` of a Hugging Face ``.arrow`` with one damaged batch: ``skip`` writes
    every other row and lists the batch in the manifest; ``raise`` stops with an error naming
    the file and the batch. Before: SIGABRT (``std::length_error``) or SIGSEGV."""
    src = tmp_path / "data-00000-of-00001.arrow"
    write_hf_stream(src)
    offset = _damage_hf_batch(src, 1)
    proc = subprocess.run(
        [sys.executable, "-c", SHARD_CHILD, str(src), str(tmp_path / "out"), on_error],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # the child ran; its rc is in the output
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if on_error == "raise":
        assert out["rc"] != 0
        assert f"{src}" in proc.stderr and "record batch 1" in proc.stderr
        assert f"byte offset {offset}" in proc.stderr
        assert not (tmp_path / "out" / "manifest.json").exists()
        return
    assert out["rc"] == 0
    assert out["keys"] == [f"{r:09d}" for r in range(ROWS) if not 4 <= r < 8]
    [skipped] = out["skipped"]
    assert skipped["source"] == str(src) and "record batch 1" in skipped["error"]


def test_a_footer_pointing_two_batches_at_one_message_is_refused(shard_dir):
    """pyarrow would serve batch 6's row as row 7, silently: the footer check refuses blocks
    that overlap, naming the footer's byte offset."""
    from stallfree.errors import CorruptShardError
    from stallfree.shards.open import open_dataset

    path = shard_dir / "shard-000000.arrow"
    data = bytearray(path.read_bytes())
    start, length = footer_span(len(data), bytes(data[-64:]), path.name)
    blocks = ipc_file_blocks(
        len(data), bytes(data[start : start + length]), start, bytes(data[:8]), path.name
    )
    entry = {}
    for b in (6, 7):
        offset, end = int(blocks.offsets[b]), int(blocks.ends[b])
        meta = int.from_bytes(data[offset + 4 : offset + 8], "little") + 8
        packed = offset.to_bytes(8, "little") + meta.to_bytes(4, "little") + bytes(4)
        entry[b] = packed + (end - offset - meta).to_bytes(8, "little")
        assert bytes(data).count(entry[b], start) == 1
    at = bytes(data).index(entry[7], start)
    data[at : at + 24] = entry[6]
    path.write_bytes(bytes(data))
    import pyarrow.ipc as ipc

    plain = ipc.open_file(pa.BufferReader(bytes(data)))  # what pyarrow alone makes of it
    assert plain.get_batch(7).column("__key__")[0].as_py() == "sample00006"
    ds = open_dataset(str(shard_dir))
    with pytest.raises(CorruptShardError, match="two blocks overlap") as err:
        ds[7]
    assert (err.value.shard, err.value.offset) == (path.name, start)


SCHEMA_CHILD = """
import json, sys
from stallfree.errors import ShardError
from stallfree.shards.open import open_dataset
from stallfree.shards.sources.registry import open_source
out = {}
try:
    ds = open_dataset(sys.argv[1])
    out["rows"] = [ds[i]["__key__"] for i in range(len(ds))]
except ShardError as exc:
    out["open"] = {"type": type(exc).__name__, "shard": exc.shard, "message": str(exc)}
src = open_source(sys.argv[1], on_error="skip")
out["samples"] = len(list(src.read_many(src.items())))
out["skipped"] = [entry["error"] for entry in src.skipped]
print(json.dumps(out))
"""


def test_a_damaged_field_name_is_a_typed_error_not_a_unicode_error(tmp_path):
    """``validate(full=True)`` checks buffers, not the schema: a struct field's name that is no
    longer UTF-8 passed every check, and converting a row was a ``UnicodeDecodeError`` from
    ``ds[i]`` and from ``stallfree shard`` (fuzz seed 202, case 122)."""
    path = tmp_path / "data.arrow"
    write_hf_stream(path)
    data = bytearray(path.read_bytes())
    at = data.index(b"path")  # the image struct's second field
    data[at] = 0xFF
    path.write_bytes(bytes(data))
    out = run_child(SCHEMA_CHILD, str(path))
    assert out["open"]["type"] == "DamagedArrowError" and out["open"]["shard"] == "data.arrow"
    assert "a field name is not UTF-8" in out["open"]["message"]
    assert out["samples"] == 0 and len(out["skipped"]) == 1
    assert "a field name is not UTF-8" in out["skipped"][0]


def test_a_stream_schema_pyarrow_cannot_read_is_skipped_by_shard(tmp_path):
    """A flipped bit in a stream's schema gave a type pyarrow does not implement: its
    ``ArrowNotImplementedError`` is neither an ``OSError`` nor a ``ValueError``, so
    ``stallfree shard --on-error skip`` let it through raw (fuzz seed 303, case 160)."""
    import random

    from .arrow_fuzz_child import mutate

    path = tmp_path / "data.arrow"
    write_hf_stream(path)
    data, _, _, _ = mutate(path.read_bytes(), random.Random("303:hf:160"), 160)
    path.write_bytes(data)
    out = run_child(SCHEMA_CHILD, str(path))
    assert out["samples"] == 0 and len(out["skipped"]) == 1
    assert "damaged Arrow IPC stream: Integers with more than 64 bits not implemented" in out["skipped"][0]


@pytest.mark.parametrize("cut", ["after a batch", "the end marker only"])
def test_a_stream_cut_on_a_message_boundary_is_read_with_a_warning(tmp_path, caplog, cut):
    """pyarrow reads a stream cut between messages as a clean end: ``open_dataset`` of a Hugging
    Face ``.arrow`` missing its last batches gave fewer rows without a word (fuzz seed 606, case
    177). The batches before the cut are read, and a warning says where it ends."""
    import logging

    from stallfree.shards.open import open_dataset
    from stallfree.shards.sources.registry import open_source

    path = tmp_path / "data.arrow"
    write_hf_stream(path)
    data = path.read_bytes()
    whole = len(open_dataset(str(path)))
    assert "cut short" not in caplog.text
    at = data.rindex(b"\xff\xff\xff\xff", 0, len(data) - 8) if cut == "after a batch" else len(data) - 8
    path.write_bytes(data[:at])
    with caplog.at_level(logging.WARNING, logger="stallfree.shards.arrow.check"):
        rows = len(open_dataset(str(path)))
    assert rows == (whole - HF_BATCH if cut == "after a batch" else whole)
    assert f"data.arrow: the Arrow stream ends at byte {at} without its end-of-stream marker" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stallfree.shards.arrow.check"):  # stallfree shard's reader
        src = open_source(str(path))
        assert len(list(src.read_many(src.items()))) == rows
    assert f"{path}: the Arrow stream ends at byte {at} without its end-of-stream marker" in caplog.text
