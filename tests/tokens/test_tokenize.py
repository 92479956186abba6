"""tokenize_files: JSONL / Parquet text -> Megatron and Arrow token shards with a tiny BPE
tokenizer built in-process (nothing downloaded)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stallfree.errors import SampleDecodeError
from stallfree.tokens.packing import TokenDataset
from stallfree.tokens.tokenize import tokenize_files
from tests.tokens.helpers import TEXTS, check_windows

tokenizers = pytest.importorskip("tokenizers")


@pytest.mark.parametrize("layout", ["megatron", "arrow"])
def test_jsonl_and_parquet_round_trip(tmp_path, tokenizer_json, layout):
    path, tok = tokenizer_json
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:20]))
    pq.write_table(pa.table({"text": TEXTS[20:]}), tmp_path / "b.parquet")
    out = tmp_path / "out"
    manifest = tokenize_files(
        [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], str(out), path, layout=layout
    )
    expected = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    assert manifest["documents"] == len(TEXTS) and manifest["tokens"] == sum(map(len, expected))
    assert manifest["dtype"] == "uint16" and len(manifest["tokenizer"]["sha256"]) == 64
    assert json.loads((out / "tokens.json").read_text()) == manifest
    assert not [p for p in os.listdir(out) if ".tmp-" in p]
    source = str(out / "tokens") if layout == "megatron" else str(out)
    eos = tok.token_to_id("<eos>")
    check_windows(TokenDataset(source, 5, eos=eos), expected, eos)


def test_bad_jsonl_line_names_file_and_offset(tmp_path, tokenizer_json):
    path, _ = tokenizer_json
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(SampleDecodeError) as exc:
        tokenize_files(str(tmp_path / "a.jsonl"), str(tmp_path / "out"), path)
    assert exc.value.shard.endswith("a.jsonl") and exc.value.offset == 15 and "line 2" in str(exc.value)
    assert not (tmp_path / "out" / "tokens.bin").exists() and not (tmp_path / "out" / "tokens.json").exists()


@pytest.mark.parametrize("layout", ["megatron", "arrow"])
def test_cli_shard_with_a_tokenizer_writes_token_files(tmp_path, tokenizer_json, layout, capsys):
    from stallfree.cli import main

    path, tok = tokenizer_json
    src = tmp_path / "text"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS[:25]))
    pq.write_table(pa.table({"body": TEXTS[25:]}), src / "b.parquet")
    out = tmp_path / "out"
    argv = ["shard", str(src), str(out), "--tokenizer", path, "--text-field", "body"]
    rc = main([*argv, "--token-layout", layout, "--token-name", "corpus", "--no-progress", "--json"])
    assert rc == 0
    manifest = json.loads(capsys.readouterr().out)
    expected = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    assert manifest == json.loads((out / "tokens.json").read_text())
    assert manifest["documents"] == len(TEXTS) and manifest["tokens"] == sum(map(len, expected))
    source = str(out / "corpus") if layout == "megatron" else str(out)
    eos = tok.token_to_id("<eos>")
    check_windows(TokenDataset(source, 5, eos=eos), expected, eos)


def test_cli_shard_with_a_tokenizer_and_no_text_is_one_error_line(tmp_path, tokenizer_json, capsys):
    from stallfree.cli import main

    path, _ = tokenizer_json
    (tmp_path / "empty").mkdir()
    rc = main(["shard", str(tmp_path / "empty"), str(tmp_path / "out"), "--tokenizer", path, "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"stallfree shard: error: no .jsonl or .parquet text files at {tmp_path / 'empty'}"]


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", "", "a\\b"])
def test_a_name_that_is_a_path_is_refused_before_anything_is_written(tmp_path, tokenizer_json, name):
    """``name`` names files inside ``dst``: ``../escaped`` wrote ``escaped.bin`` above it."""
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "hello world"}) + "\n")
    with pytest.raises(ValueError, match="is not a plain file name stem"):
        tokenize_files(str(src), str(tmp_path / "out" / "dst"), tokenizer_json[0], name=name)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["docs.jsonl", "tokenizer.json"]
