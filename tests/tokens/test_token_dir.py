"""``TokenDataset(out_dir)`` on what ``stallfree shard --tokenizer`` wrote: opened by its
``tokens.json``, either layout (the default, megatron, used to fail with "no .arrow or .parquet
files"), checked against what ``tokens.json`` records."""

from __future__ import annotations

import json

import pytest
import torch

import stallfree
from stallfree.errors import CorruptShardError, ShardError
from stallfree.tokens.packing import TokenDataset
from tests.tokens.helpers import TEXTS, check_windows, stream_of


def _shard(tmp_path, tokenizer, *layout_args: str):
    """``stallfree shard text/ out/ --tokenizer T`` (through the CLI's main); the documents'
    token ids as the tokenizer gives them."""
    from stallfree.cli import main

    path, tok = tokenizer
    src = tmp_path / "text"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path / "out"
    assert main(["shard", str(src), str(out), "--tokenizer", path, "--no-progress", *layout_args]) == 0
    return out, [tok.encode(t, add_special_tokens=False).ids for t in TEXTS], tok


@pytest.mark.parametrize("layout_args", [(), ("--token-layout", "megatron"), ("--token-layout", "arrow")])
@pytest.mark.parametrize("trailing_slash", [False, True])
def test_token_dataset_reads_the_shard_output_directory(
    tmp_path, tokenizer_json, layout_args, trailing_slash
):
    out, docs, tok = _shard(tmp_path, tokenizer_json, *layout_args)
    url = str(out) + ("/" if trailing_slash else "")
    check_windows(TokenDataset(url, seq_len=5), docs)  # every window's tokens equal the tokenizer's ids
    eos = tok.token_to_id("<eos>")
    ds = TokenDataset(url, seq_len=7, eos=eos, labels="inputs")
    tokens, _, _ = stream_of(docs, eos)
    for i in range(len(ds)):
        w = ds[i]
        assert w["input_ids"].tolist() == w["labels"].tolist() == tokens[i * 7 : (i + 1) * 7]
    # and through the loader, in its worker-less path, in order
    got = torch.cat(
        [b["input_ids"].reshape(-1) for b in stallfree.DataLoader(ds, batch_size=3, shuffle=False)]
    )
    assert got.tolist() == tokens[: len(ds) * 7]


@pytest.mark.parametrize("layout", ["megatron", "arrow"])
def test_files_that_disagree_with_tokens_json_are_an_error_naming_it(tmp_path, tokenizer_json, layout):
    out, docs, _ = _shard(tmp_path, tokenizer_json, "--token-layout", layout)
    manifest = json.loads((out / "tokens.json").read_text())
    manifest["documents"] += 1
    (out / "tokens.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptShardError) as exc:
        TokenDataset(str(out), 5)
    assert exc.value.shard == str(out / "tokens.json")
    want = f"records {len(docs) + 1} documents, {sum(map(len, docs))} uint16 tokens, but its files hold {len(docs)}"
    assert want in str(exc.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # was RecursionError, naming nothing
        ('{"format": "something.else", "version": 1}', "not a stallfree.tokens manifest"),
        ('{"format": "stallfree.tokens", "version": 9}', "version 9 is not one this stallfree reads"),
        ('{"format": "stallfree.tokens", "version": 1, "layout": "megatron"}', "incomplete tokens.json"),
    ],
)
def test_a_bad_tokens_json_is_an_error_naming_it(tmp_path, tokenizer_json, text, message):
    out, _, _ = _shard(tmp_path, tokenizer_json)
    (out / "tokens.json").write_text(text)
    with pytest.raises(ShardError, match=message) as exc:
        TokenDataset(str(out), 5)
    assert exc.value.shard == str(out / "tokens.json")


def test_megatron_files_without_tokens_json_name_the_prefix_to_pass(tmp_path, tokenizer_json):
    """tokens.json is written last: without it the run may not have finished, so the directory
    is not opened as a whole; the prefix still opens the pair explicitly."""
    out, docs, _ = _shard(tmp_path, tokenizer_json, "--token-name", "corpus")
    (out / "tokens.json").unlink()
    with pytest.raises(ShardError) as exc:
        TokenDataset(str(out), 5)
    assert "holds Megatron token files (corpus.idx) but no tokens.json" in str(exc.value)
    assert f"pass the prefix instead: {out}/corpus" in str(exc.value)
    check_windows(TokenDataset(str(out / "corpus"), 5), docs)
