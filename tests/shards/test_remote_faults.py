"""Remote reads never deliver a wrong byte: a loopback HTTP server whose bodies come back 7 bytes
short (with a matching Content-Length), that ignores Range, answers 500, hangs, or dies mid-epoch.
Every read either returns exactly the bytes of the local copy or raises a RemoteReadError naming
URL, shard, sample key, asked range and returned length. Each scenario runs in a subprocess with
a timeout (``remote_faults_child.py``), so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stallfree.shards.writer import ShardWriter
from tests.zygote import run_python

from .conftest import make_samples

N = 12
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    samples = make_samples(N, size=3000)
    for fmt in ("tar", "arrow"):
        with ShardWriter(str(root / fmt), format=fmt, max_samples=5) as w:
            for s in samples:
                w.write(s)
    with ShardWriter(str(root / "many"), format="tar", max_samples=100) as w:  # for the loader
        for s in make_samples(400, size=200):
            w.write(s)
    return root


SCENARIOS = (
    "short",
    "short-once",
    "arrow-short",
    "ignore-range",
    "dies",
    "loader-dies",
    "hang",
    "open-500",
    "open-dead",
)


@pytest.fixture(scope="module")
def observed(root) -> dict[str, list[dict]]:
    """Every scenario once, in one child process (one interpreter start for all)."""
    # ``python -m tests.shards.remote_faults_child`` from the repository root, forked from the test
    # zygote (torch and stallfree imported once for the suite's children)
    child = "tests.shards.remote_faults_child"
    code = f"import runpy\nrunpy.run_module({child!r}, run_name='__main__', alter_sys=True)"
    r = run_python(code, str(root), *SCENARIOS, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            x = json.loads(line)
            out[x["scenario"]].append(x)
    return out


def reads(lines: list[dict], what: str = "get") -> list[dict]:
    return [x for x in lines if x["what"] == what]


def tar_span(root: Path, i: int) -> tuple[str, str, int, int]:
    """(shard, key, start, end) the reader asks for sample ``i``: first header to last data byte."""
    shard = f"shard-{i // 5:06d}.tar"
    text = (root / "tar" / shard.replace(".tar", ".idx")).read_text().splitlines()[1 + i % 5].split()
    offsets = [(int(text[k + 1]), int(text[k + 2])) for k in range(0, len(text), 4)]
    return shard, text[3].rsplit(".", 1)[0], offsets[0][0] - 512, offsets[-1][0] + offsets[-1][1]


def test_short_bodies_are_errors_naming_url_key_range_and_length(root, observed):
    lines = observed["short"]
    got = reads(lines)
    assert [x["result"] for x in got] == ["error"] * N  # not one sample delivered short
    for x in got:
        shard, key, start, end = tar_span(root, x["i"])
        assert x["type"] == "RemoteReadError"
        assert (x["shard"], x["key"], x["start"], x["end"], x["got"]) == (
            shard,
            key,
            start,
            end,
            end - start - 7,
        )
        assert x["url"].endswith(f"/tar/{shard}") and x["url"].startswith("http://127.0.0.1:")
        assert (
            f"short read from {x['url']}: asked for bytes {start}..{end} ({end - start} bytes), got "
            in x["message"]
        )
        assert f"sample {key!r}" in x["message"] and "3 attempts" in x["message"]
    (many,) = reads(lines, "get_many")
    assert many["result"] == "error" and many["type"] == "RemoteReadError" and "short read" in many["message"]


def test_one_short_body_is_retried_and_the_sample_is_whole(root, observed):
    lines = observed["short-once"]
    assert [x["result"] for x in reads(lines)] == ["ok"] * N
    assert reads(lines, "get_many")[0]["result"] == "ok"
    assert reads(lines, "hit")[0]["count"] == 1  # the fault did fire once, and was read past


def test_arrow_short_bodies_are_errors(root, observed):
    lines = observed["arrow-short"]
    got = reads(lines)
    assert [x["result"] for x in got] == ["error"] * N
    for x in got:
        assert x["type"] == "RemoteReadError" and "short read" in x["message"], x
        assert x["url"].endswith(f"/arrow/shard-{x['i'] // 5:06d}.arrow")
        assert x["got"] == x["end"] - x["start"] - 7


def test_server_ignoring_range_is_an_error_not_the_wrong_bytes(root, observed):
    lines = observed["ignore-range"]
    got = reads(lines)
    assert [x["result"] for x in got] == ["error"] * N
    for x in got:
        shard, key, start, end = tar_span(root, x["i"])
        assert x["type"] == "RemoteReadError" and "does not honour HTTP Range requests" in x["message"]
        assert x["got"] == os.path.getsize(root / "tar" / shard) and (x["start"], x["end"]) == (start, end)


def test_server_dying_mid_epoch(root, observed):
    lines = observed["dies"]
    got = reads(lines)
    assert [x["result"] for x in got] == ["ok"] * (N // 2) + ["error"] * (N - N // 2)
    for x in got[N // 2 :]:
        assert x["type"] == "RemoteReadError" and x["got"] is None
        assert "Cannot connect to host 127.0.0.1" in x["message"] and x["url"] in x["message"]


def test_server_dying_mid_epoch_under_the_loader(observed):
    """Worker processes hold a forked copy of the server's listening socket; the error still
    reaches the training loop (naming the URL), not a hang until ``timeout=``."""
    lines = observed["loader-dies"]
    loaded = reads(lines, "loaded")
    assert len(loaded) >= 20 and all(x["result"] == "ok" for x in loaded)
    (end,) = reads(lines, "loader")
    assert end["result"] == "error" and end["type"] == "RemoteReadError", end
    assert "Cannot connect to host 127.0.0.1" in end["message"] and "/many/shard-000000.tar" in end["message"]


def test_hanging_server_fails_within_the_read_timeout(root, observed):
    lines = observed["hang"]
    (x,) = reads(lines)
    assert x["result"] == "error" and x["type"] == "RemoteReadError"
    assert "no answer within the timeout" in x["message"] and x["key"] == "sample00000"


def test_http_500_at_open_is_a_server_error_not_no_dataset(observed):
    (x,) = reads(observed["open-500"], "open")
    assert x["type"] == "RemoteReadError"
    assert "the server answered HTTP 500" in x["message"] and "manifest.json" in x["message"]
    assert "no dataset" not in x["message"]


def test_dead_server_at_open_names_the_url(observed):
    (x,) = reads(observed["open-dead"], "open")
    assert x["type"] == "RemoteReadError" and "no dataset" not in x["message"]
    assert "Cannot connect to host 127.0.0.1" in x["message"] and "/tar/manifest.json" in x["message"]
