"""Packed windows: every token an input exactly once per epoch, position_ids restarting at
document starts, and the same windows through stallfree.DataLoader's worker processes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import stallfree
from stallfree.tokens.packing import TokenDataset
from tests.tokens.helpers import check_windows, random_docs, stream_of, write_megatron


@pytest.mark.parametrize("seq_len", [1, 3, 16, 64])
@pytest.mark.parametrize("eos", [None, 9])
@pytest.mark.parametrize("positions", ["window", "document"])
def test_cover_every_token_once_with_restarts(tmp_path, seq_len, eos, positions):
    docs = random_docs(seq_len, n=60, max_len=40)
    docs[3], docs[4] = [], []  # empty documents are skipped (they hold only their eos)
    write_megatron(tmp_path / "c", docs, "int32")
    ds = TokenDataset(str(tmp_path / "c"), seq_len, eos=eos, positions=positions)
    check_windows(ds, docs, eos, positions)


def test_position_restart_example(tmp_path):
    write_megatron(tmp_path / "c", [[10, 11, 12], [20, 21], [30, 31, 32, 33, 34]], "int32")
    w = TokenDataset(str(tmp_path / "c"), 4, eos=0)[1]
    # stream: 10 11 12 0 | 20 21 0 30 | 31 ...
    assert w["input_ids"].tolist() == [20, 21, 0, 30]
    assert w["labels"].tolist() == [21, 0, 30, 31]
    assert w["position_ids"].tolist() == [0, 1, 2, 0]
    assert w["doc_ids"].tolist() == [1, 1, 1, 2]
    w = TokenDataset(str(tmp_path / "c"), 3, positions="document")[2]  # 10 11 12 | 20 21 30 | 31 32 33
    assert w["input_ids"].tolist() == [31, 32, 33] and w["position_ids"].tolist() == [1, 2, 3]
    assert TokenDataset(str(tmp_path / "c"), 3)[2]["position_ids"].tolist() == [0, 1, 2]


def test_last_partial_window_dropped_and_bounds(tmp_path):
    write_megatron(tmp_path / "c", [list(range(10))], "int32")
    ds = TokenDataset(str(tmp_path / "c"), 3)
    assert len(ds) == 3  # 10 tokens: windows need 4, 7, 10
    assert ds[-1]["labels"].tolist() == [7, 8, 9]
    with pytest.raises(IndexError, match="window 3 out of range"):
        ds[3]
    assert len(TokenDataset(str(tmp_path / "c"), 9)) == 1
    with pytest.raises(ValueError, match="seq_len"):
        TokenDataset(str(tmp_path / "c"), 0)


@pytest.mark.parametrize("seq_len", [10, 11, 2**62, 2**200])
def test_seq_len_at_or_over_the_corpus_is_an_error_naming_both(tmp_path, seq_len):
    """It was 0 windows, silently (and a huge seq_len tried to allocate seq_len + 1 int64s)."""
    write_megatron(tmp_path / "c", [list(range(4)), list(range(6))], "int32")
    with pytest.raises(ValueError) as exc:
        TokenDataset(str(tmp_path / "c"), seq_len)
    assert str(exc.value) == (
        f"seq_len {seq_len} is too long for c: its 10 tokens (2 documents) hold no window; "
        f"a window reads seq_len + 1 = {seq_len + 1} tokens (labels are inputs shifted by one)"
    )
    with pytest.raises(ValueError, match=r"its 11 tokens \(2 documents, eos between them\) hold no window"):
        TokenDataset(str(tmp_path / "c"), 11, eos=0)
    assert (
        len(TokenDataset(str(tmp_path / "c"), 9)) == 1
        and len(TokenDataset(str(tmp_path / "c"), 10, eos=0)) == 1
    )


def test_get_many_equals_getitem_and_pickles(tmp_path):
    docs = random_docs(7)
    write_megatron(tmp_path / "c", docs, "uint16")
    ds = TokenDataset(str(tmp_path / "c"), 5, eos=3)
    order = np.random.default_rng(0).permutation(len(ds)).tolist()
    again = pickle.loads(pickle.dumps(ds))
    for got, i in zip(again.get_many(order), order, strict=True):
        for k, v in ds[i].items():
            assert torch.equal(got[k], v)
    assert again.fingerprint == ds.fingerprint
    batch = ds.get_batch(order[:7])
    for k, v in torch.utils.data.default_collate(ds.get_many(order[:7])).items():
        assert torch.equal(batch[k], v) and batch[k].is_contiguous()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_through_the_data_loader(tmp_path, num_workers):
    docs = random_docs(8, n=200, max_len=80)
    write_megatron(tmp_path / "c", docs, "int32")
    ds = stallfree.TokenDataset(str(tmp_path / "c"), 32, eos=1)
    tokens, _, _ = stream_of(docs, 1)
    loader = stallfree.DataLoader(ds, batch_size=4, shuffle=True, seed=3, num_workers=num_workers)
    seen = []
    for batch in loader:
        assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape[1] == 32
        for row, lab in zip(batch["input_ids"].tolist(), batch["labels"].tolist(), strict=True):
            start = next(i for i in range(0, len(tokens), 32) if tokens[i : i + 32] == row)
            assert lab == tokens[start + 1 : start + 33]
            seen.append(start // 32)
    assert sorted(seen) == list(range(len(ds)))
