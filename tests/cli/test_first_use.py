"""What a new user meets first: ``--version``, every subcommand's help, the wording of the
"dataset exists" refusal on each side (CLI flag vs Python argument), and ``inspect`` on shards
without a manifest (issue 19 items 6 and 7)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import stallfree
from stallfree.cli import build_parser, main
from stallfree.errors import DatasetExistsError, WriteError
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.shards.tar.indexing import index_tars
from stallfree.shards.writer import ShardWriter
from tests.zygote import AS_MODULE, run_python


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    dst = tmp_path / "ds"
    with ShardWriter(str(dst), max_samples=3) as w:
        for i in range(7):
            w.write({"__key__": f"k{i}", "bin": bytes([i]) * (10 + i), "cls": i % 2})
    return dst


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for i in range(3):
        (src / f"s{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (src / f"s{i}.txt").write_text(f"sample {i}")
    return src


def test_version_flag_prints_the_package_torch_and_the_jpeg_decoder():
    import torch

    from stallfree.gpu_decode.jpeg_info import jpeg_decoder

    r = run_python(AS_MODULE, "stallfree", "--version", timeout=60)  # forked from the test zygote
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"stallfree {stallfree.__version__}"
    assert lines[1].startswith(f"torch {torch.__version__} (")
    assert lines[2] == f"jpeg decoder: {jpeg_decoder()}" and len(lines) == 3


def test_every_subcommand_has_a_description_and_an_example(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps options to the terminal's width
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        if name == "cache":  # a group: its own subcommands carry the descriptions
            continue
        assert parser.description and len(parser.description) > 60, name
        assert parser.epilog and f"stallfree {name}" in parser.epilog, name
        text = parser.format_help()
        assert all(len(line) <= 100 for line in text.split("usage:", 1)[1].splitlines()[:40]), name


def test_python_refusal_names_the_argument_and_cli_refusal_names_the_flag(folder, tmp_path, capsys):
    dst = tmp_path / "out"
    assert main(["shard", str(folder), str(dst), "--no-progress"]) == 0
    capsys.readouterr()
    with pytest.raises(DatasetExistsError) as info:
        shard_dataset(open_source(str(folder)), str(dst))
    assert (
        str(info.value) == f"{dst} already holds a dataset (manifest.json); pass overwrite=True to replace it"
    )
    assert isinstance(info.value, WriteError)
    again = pickle.loads(pickle.dumps(info.value))  # errors cross process boundaries
    assert type(again) is DatasetExistsError and str(again) == str(info.value)

    assert main(["shard", str(folder), str(dst), "--no-progress"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"stallfree shard: error: {dst} already holds a dataset (manifest.json); pass --overwrite to replace it"
    )


def test_index_refusal_is_worded_for_each_side(dataset, capsys):
    manifest = dataset / "manifest.json"
    with pytest.raises(DatasetExistsError, match=r"already exists; pass overwrite=True to replace it$"):
        index_tars([str(dataset)])
    assert main(["index", str(dataset), "--no-progress"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"stallfree index: error: {manifest} already exists; pass --overwrite to replace it"
    )


def test_inspect_without_a_manifest_says_so_instead_of_a_version(dataset, capsys):
    assert main(["inspect", str(dataset)]) == 0
    with_manifest = capsys.readouterr().out
    assert "format:      tar (manifest version 1)" in with_manifest
    (dataset / "manifest.json").unlink()
    assert main(["inspect", str(dataset)]) == 0
    out = capsys.readouterr().out
    assert "manifest version" not in out
    assert "format:      tar (no manifest.json: indexed on the fly; `stallfree index` writes one)" in out
    assert "samples:     7 in 3 shard(s)" in out
    assert main(["inspect", str(dataset), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["manifest"], info["version"], info["samples"]) == (False, None, 7)
