"""nanoGPT-style raw .bin files (np.memmap-written tokens) read back token-exact."""

from __future__ import annotations

import fsspec
import numpy as np
import pytest

from stallfree.errors import CorruptShardError
from stallfree.tokens.packing import TokenDataset
from stallfree.tokens.rawbin import RawBinSource
from tests.tokens.helpers import check_windows, random_docs

EOT = 50256


def nanogpt_bin(path, docs, dtype=np.uint16):
    """As nanoGPT's prepare.py: every document followed by EOT, all written with np.memmap."""
    ids = [t for d in docs for t in [*d, EOT]]
    arr = np.memmap(path, dtype=dtype, mode="w+", shape=(len(ids),))
    arr[:] = ids
    arr.flush()
    del arr
    return ids


def test_raw_bin_token_exact_one_document(tmp_path):
    ids = nanogpt_bin(tmp_path / "train.bin", random_docs(1, vocab=50000))
    ds = TokenDataset(str(tmp_path / "train.bin"), 16, dtype=np.uint16)
    assert ds.documents == 1
    check_windows(ds, [ids])  # no boundaries known: positions count from each window's start


def test_raw_bin_eos_marks_document_ends(tmp_path):
    docs = random_docs(2, vocab=50000)
    nanogpt_bin(tmp_path / "train.bin", docs)
    ds = TokenDataset(str(tmp_path / "train.bin"), 8, dtype="uint16", eos=EOT)
    # documents end after each EOT already in the stream; nothing is inserted
    check_windows(ds, [[*d, EOT] for d in docs])
    check_windows(
        TokenDataset(str(tmp_path / "train.bin"), 8, dtype="uint16", eos=EOT, positions="document"),
        [[*d, EOT] for d in docs],
        positions="document",
    )


def test_raw_bin_remote(tmp_path):
    ids = nanogpt_bin(tmp_path / "t.bin", random_docs(3, vocab=50000), np.uint32)
    fsspec.filesystem("memory").pipe("/raw/t.bin", (tmp_path / "t.bin").read_bytes())
    check_windows(TokenDataset("memory://raw/t.bin", 5, dtype=np.uint32), [ids])


def test_wrong_dtype_names_file_and_offset(tmp_path):
    np.arange(7, dtype=np.uint16).tofile(tmp_path / "odd.bin")  # 14 bytes: not whole uint32 tokens
    with pytest.raises(CorruptShardError) as exc:
        TokenDataset(str(tmp_path / "odd.bin"), 2, dtype=np.uint32)
    assert exc.value.shard == str(tmp_path / "odd.bin") and exc.value.offset == 12
    assert "not a whole number of uint32 tokens" in str(exc.value)


def test_truncated_raw_bin(tmp_path):
    np.arange(8, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(15)
    with pytest.raises(CorruptShardError) as exc:
        RawBinSource(str(tmp_path / "t.bin"), np.uint16)
    assert exc.value.offset == 14


def test_dtype_required_and_integer(tmp_path):
    np.arange(8, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(ValueError, match="pass dtype="):
        TokenDataset(str(tmp_path / "t.bin"), 2)
    with pytest.raises(ValueError, match="integer type"):
        TokenDataset(str(tmp_path / "t.bin"), 2, dtype=np.float32)
