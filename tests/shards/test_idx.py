import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.shards.errors import IndexMismatchError
from stallfree.shards.idx import IdxSample, idx_path_for, parse_idx, render_idx
from stallfree.shards.tar import TarShardWriter


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


def test_pax_path_record_later_one_wins_and_bad_lengths_stop():
    from stallfree.shards.scan import pax_path

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
