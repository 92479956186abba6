"""Things nothing of ours makes, found under a staging root where a staged file, a fetch lock,
the ``.room`` ledger or a dataset's note belongs (issue 36: "symlinks at every level, a FIFO in
place of a staged file"): a FIFO once blocked the open for ever (a loader hung, ``stallfree
staging list`` hung), a symlinked lock or ledger failed every stage with a bare ``OSError``. Now
each is replaced (a staged file fetched again), skipped (a note) or refused with a
``StagingDirError`` naming it (a directory). Each case runs in a child with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _child(root: Path, what: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "tests.shards.staging_planted_child", str(root), what],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {**json.loads(r.stdout.splitlines()[-1]), "log": r.stderr}


@pytest.mark.parametrize(
    "what", ["fifo-file", "fifo-lock", "symlink-lock", "fifo-room", "symlink-room", "fifo-note"]
)
def test_a_planted_special_file_is_replaced_and_the_right_bytes_staged(tmp_path, what):
    out = _child(tmp_path / "stage", what)
    assert (out.get("type"), out.get("same"), out["note"], out["outside"]) == (None, True, {}, False), out
    if what == "fifo-file":
        assert "is damaged (not a regular file): deleting it and fetching it again" in out["log"]
    elif what != "fifo-note":
        name = "shard.tar.lock" if what.endswith("lock") else ".room"
        assert f"{name} is not a regular file" in out["log"] and "deleting it" in out["log"]


@pytest.mark.parametrize("what", ["dir-file", "dir-lock", "dir-room"])
def test_a_directory_where_a_file_belongs_is_refused_naming_it(tmp_path, what):
    out = _child(tmp_path / "stage", what)
    name = {"dir-file": "fp/shard.tar", "dir-lock": "fp/shard.tar.lock", "dir-room": ".room"}[what]
    assert out["type"] == "StagingDirError", out
    assert f"staging directory {tmp_path / 'stage' / name} is " in out["message"]
