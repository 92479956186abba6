"""``stallfree staging list`` / ``clear`` (``stallfree/cli/staging.py``, the library in
``stallfree/storage/staging_admin.py``): what the node's staging area holds, and freeing it
without ever deleting a copy a running process reads or writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from stallfree.cli import main
from stallfree.storage.staging import StagingArea
from stallfree.storage.staging_admin import clear_staging, list_staging

TIMEOUT = 60
DAY = 86400


def _area(root):
    """Two datasets staged: ``aaaa`` (a note with its URL, two files, one used 10 days ago) and
    ``bbbb`` (no note: staged before notes were written)."""
    area = StagingArea(str(root))
    area.note("aaaa", "s3://user:secret@bucket/train?token=x")
    area.stage("aaaa", "shard-0.tar", produce=lambda: b"a" * 3000).close()
    area.stage("aaaa", "shard-1.tar", produce=lambda: b"b" * 1000).close()
    area.stage("bbbb", "x/shard.tar", produce=lambda: b"c" * 500).close()
    old = time.time() - 10 * DAY
    path = area.path_of("aaaa", "shard-1.tar")
    os.utime(path, (old, os.stat(path).st_mtime))  # last use is the atime
    return area


def test_list_shows_each_dataset_its_url_size_files_and_last_use(tmp_path, capsys):
    _area(tmp_path / "stage")
    assert main(["staging", "list", "--root", str(tmp_path / "stage"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    got = {d["fingerprint"]: (d["url"], d["bytes"], d["files"]) for d in out["datasets"]}
    assert got == {"aaaa": ("s3://bucket/train", 4000, 2), "bbbb": (None, 500, 1)}  # no credentials
    assert all(abs(d["last_use"] - time.time()) < 3600 for d in out["datasets"])
    assert main(["staging", "list", "--root", str(tmp_path / "stage")]) == 0
    text = capsys.readouterr().out
    assert "2 dataset(s)" in text and "s3://bucket/train" in text and "(not recorded)" in text


def test_list_of_no_area_says_so_and_creates_nothing(tmp_path, capsys):
    assert main(["staging", "list", "--root", str(tmp_path / "none")]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'none'}: nothing staged"
    assert not (tmp_path / "none").exists()


def test_clear_older_than_takes_only_the_unused(tmp_path, capsys):
    root = tmp_path / "stage"
    area = _area(root)
    assert main(["staging", "clear", "--root", str(root), "--older-than", "7", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert (done["removed_files"], done["removed_bytes"], done["kept_in_use"]) == (1, 1000, 0)
    assert not os.path.exists(area.path_of("aaaa", "shard-1.tar"))
    assert os.path.exists(area.path_of("aaaa", "shard-0.tar"))


def test_clear_one_dataset_removes_its_directory(tmp_path, capsys):
    root = tmp_path / "stage"
    _area(root)
    assert main(["staging", "clear", "--root", str(root), "--dataset", "aaaa"]) == 0
    assert "removed 2 file(s), 3.9 KiB" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == [".room", "bbbb"]
    assert [s.fingerprint for s in list_staging(str(root))] == ["bbbb"]
    assert main(["staging", "clear", "--root", str(root), "--dataset", "nope"]) == 1
    assert "no dataset nope staged in" in capsys.readouterr().err


def test_a_refused_root_is_an_error_naming_it(tmp_path, capsys):
    root = tmp_path / "stage"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    assert main(["staging", "clear", "--root", str(root)]) == 1
    assert f"staging directory {root} is owned by uid 65534" in capsys.readouterr().err


_PIN = textwrap.dedent("""
    import sys
    from stallfree.storage.staging import StagingArea
    area = StagingArea(sys.argv[1])
    pinned = area.stage("aaaa", "shard-0.tar", produce=lambda: b"a" * 3000)  # a reader's pin
    print("pinned", flush=True)
    sys.stdin.readline()
    pinned.close()
""")


def test_clear_never_deletes_a_copy_another_process_is_reading(tmp_path):
    root = tmp_path / "stage"
    area = _area(root)
    proc = subprocess.Popen([sys.executable, "-c", _PIN, str(root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "pinned"
        done = clear_staging(str(root))
        assert (done.removed_files, done.kept_in_use, done.kept_bytes) == (2, 1, 3000)
        assert open(area.path_of("aaaa", "shard-0.tar"), "rb").read() == b"a" * 3000
        assert done.removed_namespaces == ("bbbb",)
    finally:
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(TIMEOUT) == 0
    done = clear_staging(str(root))  # released: now it goes, and its directory
    assert (done.removed_files, done.kept_in_use, done.removed_namespaces) == (1, 0, ("aaaa",))


def test_clear_rejects_a_negative_age(tmp_path, capsys):
    assert main(["staging", "clear", "--root", str(tmp_path), "--older-than", "-1"]) == 2
    assert "--older-than must be >= 0 days" in capsys.readouterr().err
    with pytest.raises(ValueError, match="older_than_s must be >= 0"):
        clear_staging(str(tmp_path), older_than_s=-1)
