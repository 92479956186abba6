"""A token ``.bin`` cut short in place while a job reads it (re-running nanoGPT's ``prepare.py``
during training does exactly this) is an error naming the file, the byte offset and both sizes,
in the main process and through workers; through a memory map it was a SIGBUS (rc -7, or
``WorkerDiedError ... exit code -7``). Each run is a subprocess with a timeout: a regression
kills that process, not the test session."""

from __future__ import annotations

import json
import os
import pickle
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from stallfree.errors import CorruptShardError
from stallfree.tokens.packing import TokenDataset, open_tokens
from stallfree.tokens.rawbin import RawBinSource
from tests.tokens.helpers import write_megatron
from tests.zygote import run_python

TIMEOUT = 120
SEQ, BATCH, CUT = 64, 4, 1000  # the first batch's windows hold bytes 0..1028 of int32 tokens

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import stallfree
    from stallfree.errors import CorruptShardError

    source, bin_path, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ds = stallfree.TokenDataset(source, {seq}, dtype="int32")
    loader = stallfree.DataLoader(ds, batch_size={batch}, num_workers=workers, timeout=60)
    it = iter(loader)
    next(it)  # every process that reads has opened the file and read from it
    os.truncate(bin_path, {cut})
    try:
        n = sum(1 for _ in it)
    except CorruptShardError as exc:
        print(json.dumps({{"shard": exc.shard, "offset": exc.offset, "message": str(exc)}}))
        sys.exit(3)
    print("NO ERROR after", n, "batches")
    """
).format(seq=SEQ, batch=BATCH, cut=CUT)


def _corpus(tmp_path, layout):
    docs = [list(range(d * 1000, d * 1000 + 97)) for d in range(200)]  # 19,400 tokens, 303 windows
    if layout == "megatron":
        write_megatron(tmp_path / "c", docs, "int32")
        return str(tmp_path / "c"), str(tmp_path / "c.bin")
    if layout == "arrow":  # record batches of 20 documents, as a datasets.map(tokenize) cache
        table = pa.table({"input_ids": pa.array(docs, pa.list_(pa.int32()))})
        with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=20):
                w.write_batch(batch)
        return str(tmp_path / "t.arrow"), str(tmp_path / "t.arrow")
    np.asarray([t for d in docs for t in d], np.int32).tofile(tmp_path / "train.bin")
    return str(tmp_path / "train.bin"), str(tmp_path / "train.bin")


@pytest.mark.parametrize(
    ("layout", "workers"), [("megatron", 0), ("raw", 0), ("arrow", 0), ("megatron", 2), ("arrow", 2)]
)
def test_cut_short_under_the_loader_is_an_error_naming_the_file(tmp_path, layout, workers):
    source, bin_path = _corpus(tmp_path, layout)
    r = run_python(_SCRIPT, source, bin_path, str(workers), timeout=TIMEOUT)  # torch preloaded
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-3000:])  # -7 was SIGBUS
    err = json.loads(r.stdout.splitlines()[-1])
    assert f"the file is now {CUT} bytes" in err["message"] or f"it is now {CUT}" in err["message"]
    assert f"(shard {bin_path}, byte offset {CUT})" in err["message"]  # where the bytes now end
    if not workers:  # (a worker's error is re-raised from its message, torch's way: text only)
        assert err["shard"] == bin_path and err["offset"] == CUT


def test_cut_short_read_names_the_range(tmp_path):
    source, bin_path = _corpus(tmp_path, "raw")
    src = RawBinSource(source, "int32")
    assert src.read(0, 5).tolist() == [0, 1, 2, 3, 4]
    with open(bin_path, "r+b") as f:
        f.truncate(CUT)
    assert src.read(0, CUT // 4).tolist() == np.fromfile(bin_path, np.int32).tolist()  # what is left
    with pytest.raises(CorruptShardError) as exc:
        src.read(200, 300)  # bytes 800..1200: 200 of the 400 are still there
    err = exc.value
    assert err.shard == bin_path and err.offset == CUT
    assert str(err).startswith(
        f"cut short after it was opened: tokens [200, 300) are bytes 800..1200, the file is now {CUT} bytes"
    )
    with pytest.raises(CorruptShardError, match="the file is now 1000 bytes"):
        TokenDataset(src, SEQ)[10]


def _mapped(path):
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + target) for line in f)


@pytest.mark.parametrize("layout", ["megatron", "raw", "arrow"])
def test_nothing_of_the_file_stays_mapped(tmp_path, layout):
    source, bin_path = _corpus(tmp_path, layout)
    ds = TokenDataset(source, SEQ, dtype="int32")
    batch = ds.get_batch(list(range(len(ds))))
    want = [t for d in range(200) for t in range(d * 1000, d * 1000 + 97)]
    assert batch["input_ids"].reshape(-1).tolist() == want[: len(ds) * SEQ]
    assert not _mapped(bin_path)


@pytest.mark.parametrize("layout", ["megatron", "raw", "arrow"])
def test_a_file_grown_after_open_is_an_error_where_it_is_next_opened(tmp_path, layout):
    """Its index (document lengths, batch offsets) describes the old file: windows would be wrong."""
    source, bin_path = _corpus(tmp_path, layout)
    copy = pickle.loads(pickle.dumps(open_tokens(source, dtype="int32")))  # as a worker gets it
    size = os.path.getsize(bin_path)
    with open(bin_path, "ab") as f:
        f.write(bytes(64))
    with pytest.raises(CorruptShardError) as exc:
        copy.read(0, 10)
    assert exc.value.shard == bin_path and exc.value.offset == size
    assert f"changed after it was opened: it was {size} bytes, it is now {size + 64}" in str(exc.value)


@pytest.mark.parametrize("layout", ["megatron", "arrow"])
def test_threads_opening_the_file_at_once_read_right(tmp_path, layout):
    """The loader's fetch threads may all read first at once: each holds the file object it reads
    through, so one thread's open replacing another's never closes a descriptor in use."""
    from concurrent.futures import ThreadPoolExecutor

    source, _ = _corpus(tmp_path, layout)
    ds = TokenDataset(source, SEQ, dtype="int32")
    want = ds.get_batch(list(range(len(ds))))["input_ids"]
    rows = [list(range(k, len(ds), 8)) for k in range(8)]
    for _ in range(10):
        fresh = pickle.loads(pickle.dumps(ds))  # nothing opened yet
        with ThreadPoolExecutor(8) as pool:
            got = [b["input_ids"] for b in pool.map(fresh.get_batch, rows)]
        for r, g in zip(rows, got, strict=True):
            assert g.tolist() == want[r].tolist()
