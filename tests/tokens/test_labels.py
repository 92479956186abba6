"""``TokenDataset(labels=)``: the label convention is named, because Hugging Face causal-LM models
shift labels themselves. With the default ("shifted") such a model learns the token two ahead;
with "inputs" its loss is exactly the next-token cross-entropy. Checked on a real (tiny, random)
transformers model built from a config, no download."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stallfree
from stallfree.tokens.base import fingerprint_of
from stallfree.tokens.packing import TokenDataset
from tests.tokens.helpers import random_docs, stream_of, write_megatron

VOCAB = 50


@pytest.fixture
def corpus(tmp_path):
    docs = random_docs(3, n=30, max_len=30, vocab=VOCAB - 1)
    write_megatron(tmp_path / "c", docs, "uint16")
    return str(tmp_path / "c"), docs


@pytest.mark.parametrize("eos", [None, VOCAB - 1])
def test_inputs_labels_equal_input_ids_and_the_rest_is_unchanged(corpus, eos):
    path, docs = corpus
    tokens, _, _ = stream_of(docs, eos)
    shifted = TokenDataset(path, 8, eos=eos)
    inputs = TokenDataset(path, 8, eos=eos, labels="inputs")
    assert len(inputs) == len(shifted) == (len(tokens) - 1) // 8
    idx = list(range(len(shifted)))
    a, b = shifted.get_batch(idx), inputs.get_batch(idx)
    for i in idx:  # against the stream built by hand
        assert b["input_ids"][i].tolist() == tokens[i * 8 : (i + 1) * 8]
        assert b["labels"][i].tolist() == tokens[i * 8 : (i + 1) * 8]
        assert a["labels"][i].tolist() == tokens[i * 8 + 1 : (i + 1) * 8 + 1]
    for k in ("input_ids", "position_ids", "doc_ids"):
        assert torch.equal(a[k], b[k]), k
    assert b["labels"].dtype == torch.int64
    # the same windows one at a time (get_many) and as a batch
    assert all(torch.equal(w["labels"], b["labels"][i]) for i, w in enumerate(inputs.get_many(idx)))
    b["labels"][:, 0] = -100  # masking labels in place leaves the inputs alone
    assert not (b["input_ids"] == -100).any()


def test_default_is_shifted_and_keeps_its_fingerprint(corpus):
    path, _ = corpus
    ds = TokenDataset(path, 8)
    assert ds.labels == "shifted"
    assert ds.fingerprint == fingerprint_of(
        "tokens", ds.source.fingerprint, 8, None, "window"
    )  # caches stay valid
    assert (
        TokenDataset(path, 8, labels="inputs").fingerprint != ds.fingerprint
    )  # different samples, other keys


@pytest.mark.parametrize("bad", ["hf", "Inputs", "", None, True, 1])
def test_a_bad_labels_value_is_a_clear_error(corpus, bad):
    with pytest.raises(ValueError, match=r"labels must be 'shifted' .* or 'inputs' .*, got " + repr(bad)):
        TokenDataset(corpus[0], 8, labels=bad)


def test_inputs_labels_through_the_loader(corpus):
    ds = TokenDataset(corpus[0], 8, labels="inputs")
    batches = list(stallfree.DataLoader(ds, batch_size=4, shuffle=False, num_workers=0))
    assert sum(len(b["labels"]) for b in batches) == len(ds)
    assert all(torch.equal(b["labels"], b["input_ids"]) for b in batches)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100
    )


@pytest.mark.parametrize("eos", [None, VOCAB - 1])
def test_hf_causal_lm_loss_is_next_token_only_with_inputs_labels(corpus, eos):
    model = _tiny_llama()
    path, _ = corpus
    idx = [0, 3, 5, 7]
    hf = TokenDataset(path, 12, eos=eos, labels="inputs").get_batch(idx)
    ours = TokenDataset(path, 12, eos=eos).get_batch(idx)  # "shifted"
    with torch.no_grad():
        out = model(input_ids=hf["input_ids"], position_ids=hf["position_ids"], labels=hf["labels"])
        out_shifted = model(
            input_ids=ours["input_ids"], position_ids=ours["position_ids"], labels=ours["labels"]
        )
    logits = out.logits
    assert torch.equal(logits, out_shifted.logits)  # same inputs, only the labels differ
    next_token = _ce(logits[:, :-1], hf["input_ids"][:, 1:])
    two_ahead = _ce(logits[:, :-1], ours["labels"][:, 1:])  # labels[i + 1] = input_ids[i + 2]
    assert not torch.isclose(next_token, two_ahead, rtol=1e-4, atol=0)
    # labels="inputs": the model's own loss is next-token cross-entropy, and it equals the
    # "shifted" convention's loss computed by hand over the positions a shifting model scores
    torch.testing.assert_close(out.loss, next_token, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.loss, _ce(logits[:, :-1], ours["labels"][:, :-1]), rtol=1e-6, atol=0)
    # labels="shifted" fed to the same model: it is trained on the token two ahead
    torch.testing.assert_close(out_shifted.loss, two_ahead, rtol=1e-6, atol=0)


def test_hf_loss_with_inputs_labels_keeps_the_masks_it_is_given(corpus):
    """A user masking some labels (-100, e.g. a prompt) gets the masked next-token loss."""
    model = _tiny_llama()
    batch = TokenDataset(corpus[0], 12, labels="inputs").get_batch([1, 2])
    assert torch.equal(batch["labels"], batch["input_ids"])
    labels = batch["labels"].clone()
    labels[:, :5] = -100
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], labels=labels)
    torch.testing.assert_close(out.loss, _ce(out.logits[:, :-1], labels[:, 1:]), rtol=1e-6, atol=0)
