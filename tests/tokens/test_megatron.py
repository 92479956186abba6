"""Megatron .bin/.idx pairs written by an independent writer read back token-exact; every way
the pair can be wrong is an error naming the file and byte offset."""

from __future__ import annotations

import os
import struct

import fsspec
import numpy as np
import pytest

from stallfree.errors import CorruptShardError, IndexMismatchError, ShardError
from stallfree.tokens.megatron import MegatronSource, MegatronWriter
from stallfree.tokens.packing import TokenDataset
from tests.tokens.helpers import check_windows, random_docs, write_megatron


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
@pytest.mark.parametrize("eos", [None, 65535])
def test_independent_writer_reads_back_token_exact(tmp_path, dtype, eos):
    docs = random_docs(1)
    write_megatron(tmp_path / "corpus", docs, dtype)
    src = MegatronSource(str(tmp_path / "corpus"))
    assert src.dtype == np.dtype(dtype)
    assert src.doc_lengths.tolist() == [len(d) for d in docs]
    flat = [t for d in docs for t in d]
    assert src.read(0, len(flat)).tolist() == flat
    for spelled in ("corpus", "corpus.bin", "corpus.idx"):
        ds = TokenDataset(str(tmp_path / spelled), 7, eos=eos)
        check_windows(ds, docs, eos)


def test_multimodal_modes_are_accepted(tmp_path):
    docs = random_docs(2, n=5)
    write_megatron(tmp_path / "m", docs, "int32", modes=True)
    check_windows(TokenDataset(str(tmp_path / "m"), 4), docs)


def test_our_writer_matches_the_documented_layout(tmp_path):
    docs = random_docs(3)
    write_megatron(tmp_path / "theirs", docs, "uint16")
    with MegatronWriter(str(tmp_path / "ours"), dtype="uint16") as w:
        for d in docs:
            w.write(np.array(d))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_remote_ranged_reads(tmp_path):
    docs = random_docs(4)
    write_megatron(tmp_path / "r", docs, "int32")
    mem = fsspec.filesystem("memory")
    for ext in (".bin", ".idx"):
        mem.pipe(f"/tokens/r{ext}", (tmp_path / f"r{ext}").read_bytes())
    ds = TokenDataset("memory://tokens/r", 9, eos=7)
    check_windows(ds, docs, 7)


def test_truncated_bin_names_file_and_offset(tmp_path):
    docs = [[1, 2, 3], [4, 5, 6, 7]]
    write_megatron(tmp_path / "t", docs, "int32")
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(CorruptShardError) as exc:
        MegatronSource(str(tmp_path / "t"))
    assert exc.value.shard == str(tmp_path / "t.bin") and exc.value.offset == 20
    assert "truncated .bin" in str(exc.value) and "28 bytes" in str(exc.value)
    assert f"shard {tmp_path / 't.bin'}" in str(exc.value) and "byte offset 20" in str(exc.value)


def test_bin_longer_than_idx_says(tmp_path):
    write_megatron(tmp_path / "t", [[1, 2, 3]], "int32")
    with open(tmp_path / "t.bin", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(IndexMismatchError) as exc:
        MegatronSource(str(tmp_path / "t"))
    assert exc.value.shard == str(tmp_path / "t.bin") and exc.value.offset == 12


def test_idx_pointer_disagrees_with_bin(tmp_path):
    write_megatron(tmp_path / "t", [[1, 2], [3, 4]], "int32", pointers=[0, 12])
    with pytest.raises(IndexMismatchError) as exc:
        MegatronSource(str(tmp_path / "t"))
    # the second pointer: header 34 + two int32 lengths + one int64 pointer
    assert exc.value.shard == str(tmp_path / "t.idx") and exc.value.offset == 34 + 8 + 8
    assert "sequence 1 starts at .bin byte 12" in str(exc.value)


def test_truncated_idx(tmp_path):
    write_megatron(tmp_path / "t", [[1, 2], [3, 4]], "int32")
    data = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(data[:-5])
    with pytest.raises(CorruptShardError) as exc:
        MegatronSource(str(tmp_path / "t"))
    assert exc.value.shard == str(tmp_path / "t.idx") and exc.value.offset == len(data) - 5


def test_wrong_dtype_names_the_idx_dtype_byte(tmp_path):
    write_megatron(tmp_path / "t", [[1, 2, 3]], "uint16")
    with pytest.raises(IndexMismatchError) as exc:
        TokenDataset(str(tmp_path / "t"), 2, dtype="int32")
    assert exc.value.shard == str(tmp_path / "t.idx") and exc.value.offset == 17
    assert "says its tokens are uint16" in str(exc.value)
    TokenDataset(str(tmp_path / "t"), 2, dtype="uint16")  # the right one is fine


def test_bad_magic_and_unknown_code(tmp_path):
    write_megatron(tmp_path / "t", [[1, 2, 3]], "uint16")
    data = bytearray((tmp_path / "t.idx").read_bytes())
    (tmp_path / "t.idx").write_bytes(b"XXIDIDX\0\0" + bytes(data[9:]))
    with pytest.raises(CorruptShardError, match="not a Megatron .idx") as exc:
        MegatronSource(str(tmp_path / "t"))
    assert exc.value.offset == 0
    data[17] = 42
    (tmp_path / "t.idx").write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="unknown dtype code 42") as exc:
        MegatronSource(str(tmp_path / "t"))
    assert exc.value.offset == 17


def test_missing_idx(tmp_path):
    write_megatron(tmp_path / "t", [[1]], "uint16")
    os.remove(tmp_path / "t.idx")
    with pytest.raises(ShardError):
        MegatronSource(str(tmp_path / "t"))


def test_header_struct_is_34_bytes():
    assert struct.calcsize("<9sQBQQ") == 34
