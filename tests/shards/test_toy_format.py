"""A new format is one file plus one registry line (``docs/ARCHITECTURE.md``; issue 31): the toy
"jsonl" format of ``jsonl_format.py``, registered by the one ``register_format`` line below, is
written by ``ShardWriter``, opened by ``open_dataset`` with a manifest and without one (its own
opaque index made by its scan, handed back to its reader, pickled into workers), verified, and
read by the loader's worker processes, with no change to the package."""

from __future__ import annotations

import json
import pickle
import textwrap
from pathlib import Path

import pytest

from stallfree.errors import CorruptShardError, HashMismatchError
from stallfree.shards import formats
from stallfree.shards.open import open_dataset
from stallfree.shards.verify import verify_dataset
from stallfree.shards.writer import ShardWriter
from tests.zygote import run_python

from .jsonl_format import LineIndex

REPO = Path(__file__).resolve().parents[2]
REGISTER = 'register_format("jsonl", "tests.shards.jsonl_format:JSONL")'  # the one registry line


@pytest.fixture
def jsonl():
    formats.register_format("jsonl", "tests.shards.jsonl_format:JSONL")  # = REGISTER
    yield
    formats.unregister_format("jsonl")


def _samples(n: int) -> list[dict]:
    return [
        {"__key__": f"k/{i:03d}", "txt": f"caption {i} é".encode(), "cls": str(i % 3).encode()}
        for i in range(n)
    ]


def _write(dst: Path, samples: list[dict]) -> None:
    with ShardWriter(str(dst), format="jsonl", max_samples=4) as w:
        for s in samples:
            w.write(s)


def test_written_opened_read_back_and_verified(jsonl, tmp_path):
    dst, samples = tmp_path / "ds", _samples(10)
    _write(dst, samples)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["format"] == "jsonl" and [s["samples"] for s in manifest["shards"]] == [4, 4, 2]
    assert sorted(p.name for p in dst.iterdir()) == ["manifest.json"] + [
        f"shard-00000{i}.jsonl" for i in range(3)
    ]
    ds = open_dataset(str(dst))
    assert ds.format == "jsonl" and len(ds) == 10
    assert [ds[i] for i in range(10)] == samples  # byte-equal
    assert list(ds) == samples
    assert ds.get_many([9, 0, 5]) == [samples[9], samples[0], samples[5]]
    assert [ds.key_of(i) for i in range(10)] == [s["__key__"] for s in samples]
    assert ds.verify() == [] and verify_dataset(str(dst)).ok

    shard = dst / "shard-000001.jsonl"
    shard.write_bytes(shard.read_bytes().replace(b"caption 5", b"caption X"))  # same size
    found = verify_dataset(str(dst))
    assert [(type(e), e.shard) for e in found.errors] == [(HashMismatchError, "shard-000001.jsonl")]


def test_opened_without_a_manifest_through_its_own_index(jsonl, tmp_path):
    dst, samples = tmp_path / "ds", _samples(10)
    _write(dst, samples)
    (dst / "manifest.json").unlink()
    ds = open_dataset(str(dst))  # scanned by the format: one LineIndex per shard
    assert [type(i) for i in ds._scanned] == [LineIndex] * 3
    assert ds._scanned[1].keys == ("k/004", "k/005", "k/006", "k/007")
    assert list(ds) == samples and ds[7] == samples[7] and ds.key_of(9) == "k/009"
    assert ds.verify() == []
    copy = pickle.loads(pickle.dumps(ds))  # what a loader worker gets
    assert copy._scanned == ds._scanned and copy.get_many([3, 8]) == [samples[3], samples[8]]
    one = open_dataset(str(dst / "shard-00000{1..2}.jsonl"))
    assert list(one) == samples[4:]


def test_a_damaged_line_names_the_shard_and_its_offset(jsonl, tmp_path):
    dst = tmp_path / "ds"
    _write(dst, _samples(6))
    (dst / "manifest.json").unlink()
    shard = dst / "shard-000001.jsonl"
    data = shard.read_bytes()
    shard.write_bytes(data + b'{"__key__": "k/x", "txt": \n')
    with pytest.raises(CorruptShardError, match="line is not JSON") as info:
        open_dataset(str(dst))
    assert (info.value.shard, info.value.offset) == ("shard-000001.jsonl", len(data))


LOADER_CHILD = f"""
import json, sys
import stallfree
from stallfree.shards.formats import register_format
from stallfree.shards.open import open_dataset
{REGISTER}
out = {{}}
# forked workers inherit the registry; spawned ones start with the built-ins only
for name, url, context in (("manifest", sys.argv[1], "fork"), ("scanned", sys.argv[2], "spawn")):
    ds = open_dataset(url)
    loader = stallfree.DataLoader(ds, batch_size=3, shuffle=True, seed=4, num_workers=2,
                                  multiprocessing_context=context, collate_fn=list)
    out[name] = sorted([s["__key__"], s["txt"].decode(), s["cls"].decode()] for batch in loader for s in batch)
print(json.dumps(out))
"""


@pytest.mark.slow  # spawned workers import torch
def test_the_loader_reads_it_in_worker_processes(tmp_path):
    """In a child interpreter (a hang or crash fails this test only), which registers the format
    with the one line; spawned workers start without it and get it from the dataset."""
    samples = _samples(9)
    formats.register_format("jsonl", "tests.shards.jsonl_format:JSONL")
    try:
        _write(tmp_path / "ds", samples)
        _write(tmp_path / "plain", samples)
    finally:
        formats.unregister_format("jsonl")
    (tmp_path / "plain" / "manifest.json").unlink()
    child = textwrap.dedent(LOADER_CHILD)  # torch preloaded (tests/zygote.py); the registry its own
    proc = run_python(child, str(tmp_path / "ds"), str(tmp_path / "plain"), timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = sorted([s["__key__"], s["txt"].decode(), s["cls"].decode()] for s in samples)
    assert out == {"manifest": expected, "scanned": expected}
