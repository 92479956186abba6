import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.errors import IndexMismatchError
from stallfree.shards.tar.idx import IdxSample, idx_path_for, parse_idx, render_idx
from stallfree.shards.tar.writer import TarShardWriter


def test_matches_dali_wds2idx(tmp_path, samples):
    """Our .idx is byte-identical to the one DALI's own wds2idx tool builds from the tar."""
    with TarShardWriter(str(tmp_path / "s.tar")) as w:
        for s in samples:
            w.write(s)
    tool = Path(sys.executable).with_name("wds2idx")
    if not tool.exists():
        pytest.skip("DALI's wds2idx not installed")
    subprocess.run(
        [str(tool), str(tmp_path / "s.tar"), str(tmp_path / "dali.idx")], check=True, capture_output=True
    )
    assert (tmp_path / "s.idx").read_text() == (tmp_path / "dali.idx").read_text()


def test_round_trip():
    samples = [
        IdxSample("a", [("cls", 512, 1, "a.cls"), ("jpg", 1536, 900, "a.jpg")]),
        IdxSample("d/b", [("x", 3072, 0, "d/b.x")]),
    ]
    text = render_idx(samples)
    assert text.splitlines()[0] == "v1.2 2"
    assert parse_idx(text, "s.tar") == samples


def test_idx_path():
    assert idx_path_for("/d/shard-000001.tar") == "/d/shard-000001.idx"
    assert idx_path_for("x.tar.gz") == "x.tar.gz.idx"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("v1.1 1\njpg 512 3\n", "must start with 'v1.2 N'"),
        ("v1.2 2\njpg 512 3 a.jpg\n", "says 2 samples but has 1"),
        ("v1.2 1\njpg 512 3\n", "groups of"),
        ("v1.2 1\njpg x 3 a.jpg\n", "bad offset"),
        ("v1.2 1\njpg 512 3 a.jpg png 1536 3 b.png\n", "does not belong"),
        ("v1.2 1\njpg 100 3 a.jpg\n", "impossible"),
    ],
)
def test_malformed(text, message):
    with pytest.raises(IndexMismatchError, match=message) as info:
        parse_idx(text, "s.tar")
    assert info.value.shard == "s.tar"


GOOD = "jpg 512 3 a.jpg"


@pytest.mark.parametrize(
    "bad, message, offset",
    [
        ("jpg 512 3", "expected groups of 'FIELD OFFSET SIZE NAME'", None),
        ("jpg x 3 b.jpg", "bad offset/size 'x' '3'", None),
        ("jpg 100 3 b.jpg", "impossible offset/size", 100),
        ("jpg 2048 3 b.jpg png 3072 3 c.png", "member 'c.png' does not belong to the sample", 3072),
    ],
)
@pytest.mark.parametrize(
    "before, lineno",
    [
        ([GOOD], 3),  # no blank line: header, good line, bad line
        (["", GOOD], 4),  # a blank line before the good one
        (["", "  ", GOOD, "\t"], 6),  # blank and whitespace-only lines
        ([GOOD, ""], 4),  # a blank line right before the bad one
    ],
)
def test_malformed_line_named_by_its_line_in_the_file(before, lineno, bad, message, offset):
    text = "\n".join(["v1.2 2", *before, bad]) + "\n"
    assert text.split("\n")[lineno - 1] == bad  # the number is the line an editor shows
    with pytest.raises(IndexMismatchError) as info:
        parse_idx(text, "s.tar")
    assert info.value.reason == f".idx line {lineno}: {message}"
    assert (info.value.shard, info.value.offset) == ("s.tar", offset)


def test_crlf_and_blank_lines_parse_and_count_lines():
    text = "v1.2 2\r\n\r\njpg 512 3 a.jpg\r\n\r\njpg 1536 3 b.jpg\r\n"
    assert parse_idx(text, "s.tar") == [
        IdxSample("a", [("jpg", 512, 3, "a.jpg")]),
        IdxSample("b", [("jpg", 1536, 3, "b.jpg")]),
    ]
    with pytest.raises(IndexMismatchError) as info:
        parse_idx(text.replace("1536", "15x6"), "s.tar")
    assert info.value.reason == ".idx line 5: bad offset/size '15x6' '3'"


def test_reader_names_the_real_line_of_a_bad_idx(tar_dataset):
    """Through ``open_dataset``: a blank line in a shard's .idx, then a bad entry further down."""
    from stallfree.shards.open import open_dataset

    idx = tar_dataset / "shard-000001.idx"
    lines = idx.read_text().split("\n")
    lines[3] += " x"  # the third sample's entry (line 4) gets a stray token
    lines.insert(1, "")  # ... and is line 5 once a blank line precedes it
    idx.write_text("\n".join(lines))
    with pytest.raises(IndexMismatchError) as info:
        open_dataset(str(tar_dataset))[5]
    assert info.value.shard == "shard-000001.tar"
    assert info.value.reason == ".idx line 5: expected groups of 'FIELD OFFSET SIZE NAME'"


def test_pax_path_record_later_one_wins_and_bad_lengths_stop():
    from stallfree.shards.tar.walk import pax_path

    def rec(key: str, value: str) -> bytes:
        body = f" {key}={value}\n"
        n = len(body) + 2
        n = len(f"{n}{body}")
        return f"{n}{body}".encode()

    assert pax_path(rec("mtime", "0") + rec("path", "a/b.jpg")) == "a/b.jpg"
    assert pax_path(rec("path", "first.jpg") + rec("path", "second.jpg")) == "second.jpg"
    assert pax_path(rec("mtime", "0")) is None
    assert pax_path(b"0 path=x\n") is None
    assert pax_path(b"garbage") is None
