"""A tiny BPE ``tokenizer.json`` trained in-process (nothing downloaded), for the tokenize tests."""

from __future__ import annotations

import pytest

from tests.tokens.helpers import TEXTS


@pytest.fixture
def tokenizer_json(tmp_path):
    """(path of a saved tokenizer.json, the tokenizer); skipped without the tokenizers package."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<eos>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path), tok
