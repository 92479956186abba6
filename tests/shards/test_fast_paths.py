"""The tar reader's fast paths give exactly what the general paths give: the bulk ``.idx`` parse
(``uniform_columns``) against ``parse_idx``, and sequential iteration (``iter_rows``) against
random access, byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallfree.errors import IndexMismatchError
from stallfree.shards.open import open_dataset
from stallfree.shards.tar.idx import idx_path_for, parse_idx
from stallfree.shards.tar.reader import TarShardReader, uniform_columns
from stallfree.shards.writer import ShardWriter

from .conftest import make_samples, tar_field


def _write(root: Path, samples: list[dict], max_samples: int = 4) -> Path:
    with ShardWriter(str(root), format="tar", max_samples=max_samples) as w:
        for s in samples:
            w.write(s)
    return root


def _columns(reader: TarShardReader) -> tuple:
    return (
        reader._keys,
        reader._names,
        list(reader._fid),
        list(reader._starts),
        list(reader._ends),
        list(reader._first),
    )


def _readers(root: Path) -> list[tuple[TarShardReader, TarShardReader]]:
    """(bulk-parsed reader, reader built from parse_idx's samples) per shard."""
    ds = open_dataset(str(root))
    pairs = []
    for s, info in enumerate(ds.manifest.shards):
        path = ds.shard_path(s)
        slow = parse_idx(Path(idx_path_for(path)).read_bytes(), info.path)
        pairs.append(
            (TarShardReader(ds.fs, path, info.path, info), TarShardReader(ds.fs, path, info.path, info, slow))
        )
    return pairs


@pytest.mark.parametrize("fields", [("jpg",), ("cls", "jpg"), ("cls", "jpg", "txt")])
def test_bulk_index_parse_equals_full_parser(tmp_path, fields):
    samples = [{"__key__": s["__key__"], **{f: s[f] for f in fields}} for s in make_samples(11)]
    for fast, slow in _readers(_write(tmp_path / "ds", samples)):
        assert fast._uniform and not slow._uniform
        assert _columns(fast) == _columns(slow)
        assert fast._names == sorted(fields)  # the writer's member order


def test_bulk_parse_declines_mixed_fields_and_reader_still_reads(tmp_path):
    samples = make_samples(9)
    del samples[2]["txt"]  # one sample without a caption: rows are not uniform
    root = _write(tmp_path / "ds", samples, max_samples=9)
    ds = open_dataset(str(root))
    path, info = ds.shard_path(0), ds.manifest.shards[0]
    text = Path(idx_path_for(path)).read_bytes()
    assert uniform_columns(text, info.bytes, info.samples) is None
    reader = ds._reader(0)
    assert not reader._uniform
    got = list(ds)
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples]
    assert "txt" not in got[2] and got[3]["txt"] == b"caption 3"
    assert got == [ds[i] for i in range(len(ds))]


def test_bulk_parse_declines_what_the_full_parser_must_judge(tar_dataset):
    ds = open_dataset(str(tar_dataset))
    path, info = ds.shard_path(0), ds.manifest.shards[0]
    text = Path(idx_path_for(path)).read_text()
    columns = uniform_columns(text, info.bytes, info.samples)
    assert columns is not None
    last_end = max(columns[4])
    assert uniform_columns(text, last_end, info.samples) is not None
    assert uniform_columns(text, info.bytes, info.samples + 1) is None  # count differs from the manifest
    assert uniform_columns(text, last_end - 1, info.samples) is None  # an entry past the end of the file
    lines = text.splitlines()
    bad_offset = "\n".join([lines[0], lines[1].replace(" ", " x", 1), *lines[2:]])
    assert uniform_columns(bad_offset, info.bytes, info.samples) is None
    key1 = lines[2].split()[3].rsplit(".", 1)[0]
    wrong_key = "\n".join([lines[0], lines[1], lines[2].replace(key1 + ".", "other.", 1), *lines[3:]])
    assert uniform_columns(wrong_key, info.bytes, info.samples) is None
    # the full parser then names the problem, as before
    Path(idx_path_for(path)).write_text(wrong_key + "\n")
    with pytest.raises(IndexMismatchError, match="does not belong to the sample"):
        ds[0]


def test_bulk_parse_accepts_other_whitespace_like_the_full_parser(tar_dataset):
    """Tabs or repeated spaces (wds2idx-like tools) parse to the same columns."""
    ds = open_dataset(str(tar_dataset))
    path = ds.shard_path(1)
    idx = Path(idx_path_for(path))
    before = _columns(ds._reader(1))
    lines = idx.read_text().splitlines()
    idx.write_text("\n".join([lines[0], *(line.replace(" ", "\t  ") for line in lines[1:])]) + "\n")
    again = open_dataset(str(tar_dataset))
    assert again._reader(1)._uniform
    assert _columns(again._reader(1)) == before


@pytest.mark.parametrize("fields", [("jpg",), ("cls", "jpg"), ("cls", "jpg", "txt")])
def test_iteration_equals_random_access_byte_for_byte(tmp_path, fields):
    samples = [{"__key__": s["__key__"], **{f: s[f] for f in fields}} for s in make_samples(13)]
    ds = open_dataset(str(_write(tmp_path / "ds", samples)))
    seq = list(ds)
    assert len(seq) == len(samples) == len(ds)
    for i, (got, want) in enumerate(zip(seq, samples, strict=True)):
        assert list(got) == ["__key__", *sorted(fields)]
        assert got["__key__"] == want["__key__"]
        for f in fields:
            assert type(got[f]) is bytes
            assert got[f] == tar_field(want[f])
        assert got == ds[i]
    assert seq == ds.get_many(list(range(len(ds))))
    assert list(ds) == seq  # a second pass over the open shards


def test_iteration_of_a_fresh_dataset_equals_an_open_one(tar_dataset, samples):
    warm = open_dataset(str(tar_dataset))
    expected = [warm[i] for i in range(len(warm))]
    fresh = open_dataset(str(tar_dataset))
    assert list(fresh) == expected
    assert [s["jpg"] for s in expected] == [s["jpg"] for s in samples]


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (["512", "0", "007", "123456789012345678"], [512, 0, 7, 123456789012345678]),
        (["+5"], None),
        (["-5"], None),
        (["1_000"], None),
        (["٣"], None),  # a non-ASCII digit: int() takes it, the bulk path leaves it to parse_idx
        (["999999999999999999"], [999999999999999999]),
        (["1234567890123456789"], None),  # 10**18 or more
        (["5", "99999999999999999999"], None),  # past int64: numpy saturates, we decline
        (["12a"], None),
    ],
)
def test_decimal_columns(tokens, expected):
    from stallfree.shards.tar.reader import _decimals

    got = _decimals(tokens)
    assert (got if got is None else got.tolist()) == expected


def test_unusual_numbers_in_idx_go_through_the_full_parser(tar_dataset, samples):
    """``+1536`` is a number to int(): the bulk path declines it, parse_idx reads it, same samples."""
    ds = open_dataset(str(tar_dataset))
    path, info = ds.shard_path(0), ds.manifest.shards[0]
    idx = Path(idx_path_for(path))
    text = idx.read_text()
    assert uniform_columns(text, info.bytes, info.samples) is not None
    lines = text.splitlines()
    tokens = lines[1].split()
    tokens[1] = "+" + tokens[1]
    idx.write_text("\n".join([lines[0], " ".join(tokens), *lines[2:]]) + "\n")
    assert uniform_columns(idx.read_text(), info.bytes, info.samples) is None
    fresh = open_dataset(str(tar_dataset))
    assert not fresh._reader(0)._uniform
    assert [s["jpg"] for s in list(fresh)[:5]] == [s["jpg"] for s in samples[:5]]
