"""Seeded fuzzing of the files other libraries write: MDS ``index.json`` and shard bytes, LitData
``index.json`` and chunk bytes, Hugging Face ``state.json`` / ``dataset_info.json``. Each case
damages one file of a small valid dataset (bytes flipped, cut, inserted; or one JSON value
replaced), then opens and reads it every way we do: ``open_source`` + every item (what
``stallfree shard`` reads) and, for MDS and LitData, ``open_dataset`` + every sample (in place).
A failure must be a typed ``ShardError`` whose message names the damaged file; nothing else
(``zlib.error``, ``KeyError``, ``RecursionError``...) may escape. In-process: every parser here is
Python or a bounded codec (zlib, bz2, json), none that could take the interpreter down."""

from __future__ import annotations

import copy
import gzip
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stallfree.errors import ShardError
from stallfree.shards.open import open_dataset
from stallfree.shards.sources.registry import open_source
from tests.shards.test_source_litdata import write_litdata
from tests.shards.test_source_mds import write_mds

SEED = 20261206
DEEP = 100_000

_ODD_VALUES: list[Any] = [None, -1, 0, 2**40, 1.5, True, "", "../x", "/etc/passwd", "pkl", "gz", "zstd",
                          [], {}, [None], {"a": 1}, "x" * 300]  # fmt: skip


def _mds(root: Path) -> None:
    rows = [{"image": bytes([i]) * (20 + i), "label": i, "caption": f"c{i}",
             "emb": np.arange(i + 1, dtype=np.float32)} for i in range(7)]  # fmt: skip
    write_mds(root, {"image": "jpeg", "label": "int", "caption": "str", "emb": "ndarray"}, rows,
              per_shard=3, gz_shards=(1,))  # fmt: skip


def _litdata(root: Path) -> None:
    rows = [{"image": bytes([i]) * (20 + i), "label": i, "name": f"n{i}",
             "mask": np.arange(i + 1, dtype=np.uint8)} for i in range(7)]  # fmt: skip
    write_litdata(root, rows, per_chunk=3)


def _paths(obj: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON value (as key paths), the value itself included."""
    out = [at]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*at, i))
    return out


def _replace(obj: Any, at: tuple, value: Any) -> Any:
    if not at:
        return value
    obj = copy.deepcopy(obj)
    node = obj
    for k in at[:-1]:
        node = node[k]
    node[at[-1]] = value
    return obj


def _damage_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    how = rng.randrange(4)
    if how == 0 and buf:
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif how == 1:
        del buf[rng.randrange(len(buf) + 1) :]
    elif how == 2:
        at = rng.randrange(len(buf) + 1)
        buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 12)))
    elif buf:
        at = rng.randrange(len(buf))
        buf[at : at + rng.randint(1, 64)] = bytes(min(64, len(buf) - at))
    return bytes(buf)


def _damage_json(data: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.3:
        return _damage_bytes(data, rng)
    obj = json.loads(data)
    at = rng.choice(_paths(obj))
    return json.dumps(_replace(obj, at, rng.choice(_ODD_VALUES))).encode()


def _read_as_source(root: Path) -> None:
    source = open_source(str(root))
    for got in source.read_many(source.items()):
        if isinstance(got, Exception):
            raise got


def _read_in_place(root: Path) -> None:
    ds = open_dataset(str(root))
    for i in range(len(ds)):
        ds[i]


def _check(root: Path, damaged: str, in_place: bool) -> list[str]:
    """Read the damaged dataset each way; an error must be a ShardError naming the file."""
    outcomes = []
    for read in (_read_as_source, _read_in_place) if in_place else (_read_as_source,):
        try:
            read(root)
        except ShardError as exc:
            message = str(exc)
            assert damaged in message, (
                f"{read.__name__}: {type(exc).__name__} does not name {damaged}: {message}"
            )
            outcomes.append(type(exc).__name__)
        else:
            outcomes.append("ok")
    return outcomes


def _fuzz(tmp_path: Path, make, files: list[str], cases: int, seed: int, in_place: bool) -> dict[str, int]:
    clean = tmp_path / "clean"
    make(clean)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for case in range(cases):
        root = tmp_path / f"case{case}"
        shutil.copytree(clean, root)
        name = rng.choice(files)
        data = (root / name).read_bytes()
        damaged = _damage_json(data, rng) if name.endswith(".json") else _damage_bytes(data, rng)
        (root / name).write_bytes(damaged)
        for outcome in _check(root, name, in_place):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(root)
    return outcomes


def test_fuzzed_mds_gives_typed_errors_naming_the_file(tmp_path):
    files = ["index.json", "index.json", "shard.00000.mds", "shard.00001.mds.gz", "shard.00002.mds"]
    outcomes = _fuzz(tmp_path, _mds, files, 120, SEED, in_place=True)
    assert sum(n for k, n in outcomes.items() if k != "ok") >= 120, outcomes  # the damage was seen


def test_fuzzed_litdata_gives_typed_errors_naming_the_file(tmp_path):
    files = ["index.json", "index.json", "chunk-0-0.bin", "chunk-0-1.bin", "chunk-0-2.bin"]
    outcomes = _fuzz(tmp_path, _litdata, files, 100, SEED + 1, in_place=True)
    assert sum(n for k, n in outcomes.items() if k != "ok") >= 100, outcomes


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory) -> Path:
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hf") / "saved"
    datasets.Dataset.from_dict({"x": list(range(8)), "t": [f"r{i}" for i in range(8)]}).save_to_disk(
        str(root), num_shards=2
    )
    return root


def test_fuzzed_hf_json_gives_typed_errors_naming_the_file(hf_saved, tmp_path):
    def make(root: Path) -> None:
        shutil.copytree(hf_saved, root)

    outcomes = _fuzz(tmp_path, make, ["state.json", "dataset_info.json"], 80, SEED + 2, in_place=False)
    assert sum(n for k, n in outcomes.items() if k != "ok") >= 20, outcomes


def _deep(n: int = DEEP) -> bytes:
    return b"[" * n + b"]" * n


@pytest.mark.parametrize("make, kind", [(_mds, "mds"), (_litdata, "litdata")])
def test_index_json_nested_100000_deep_is_a_typed_error(make, kind, tmp_path):
    make(tmp_path / "ds")
    (tmp_path / "ds" / "index.json").write_bytes(_deep())
    # (open_source's kind detection, sources.py, reads index.json with json.loads: given the kind)
    for opener in (open_dataset, lambda root: open_source(root, kind)):
        with pytest.raises(ShardError, match="nested too deeply") as info:
            opener(str(tmp_path / "ds"))
        assert str(tmp_path / "ds" / "index.json") in str(info.value)


@pytest.mark.parametrize("name", ["state.json", "dataset_info.json"])
def test_hf_json_nested_100000_deep_is_a_typed_error(hf_saved, name, tmp_path):
    root = tmp_path / "saved"
    shutil.copytree(hf_saved, root)
    (root / name).write_bytes(b'{"a": ' + _deep() + b"}")
    with pytest.raises(ShardError, match="nested too deeply") as info:
        open_source(str(root))
    assert f"{root}/{name}" in str(info.value)


def test_dataset_dict_json_nested_100000_deep_still_names_the_dict(tmp_path):
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "dataset_dict.json").write_bytes(_deep())
    with pytest.raises(ShardError, match=r"DatasetDict with splits \(none listed\)"):
        open_dataset(str(tmp_path / "dd"))


def test_the_mds_fixture_reads_clean(tmp_path):
    """The fuzz's base dataset is valid (so what fails, fails for the damage)."""
    _mds(tmp_path / "m")
    _litdata(tmp_path / "l")
    assert _check(tmp_path / "m", "-", True) == _check(tmp_path / "l", "-", True) == ["ok", "ok"]
    assert gzip.decompress((tmp_path / "m" / "shard.00001.mds.gz").read_bytes())[:4] == b"\x03\x00\x00\x00"
