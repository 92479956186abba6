"""A staged copy is checked before a process first uses it (issue 36 item 2), its digest taken
once per node, and the cap counts files while they are written (item 8). Area-level cases; the
loader-level ones are in ``tests/s3/test_s3_staging.py``."""

from __future__ import annotations

import logging
import os
import pickle
import threading

import pytest

from stallfree.storage import digests, staging
from stallfree.storage.staging import Expected, StagingArea, StagingFullError

DATA = bytes(range(256)) * 40


def _expected(data=DATA):
    h = digests.fast_hasher()
    h.update(data)
    return Expected(len(data), "xxh3-128", h.hexdigest())


class _Fills:
    """A fill that writes ``data`` and counts its calls (what a fetch is here)."""

    def __init__(self, data=DATA):
        self.data, self.calls = data, 0

    def __call__(self, f):
        self.calls += 1
        f.write(self.data)


@pytest.fixture
def hashes(monkeypatch):
    """How many times the area took a digest of a staged file."""
    count = [0]
    real = digests.update_from_fd

    def counting(*args):
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(staging.digests, "update_from_fd", counting)
    monkeypatch.setattr(staging, "_CHECKED", {})  # this process has checked nothing yet
    return count


def _stage(area, fill, expect=None):
    return area.stage("fp", "shard.tar", fill, size=len(fill.data), expect=expect or _expected(fill.data))


def test_a_copy_fetched_here_is_not_hashed_again_and_the_node_hashes_once(tmp_path, hashes, monkeypatch):
    area, fill = StagingArea(str(tmp_path)), _Fills()
    _stage(area, fill).close()  # fetched: the fill checked it (StagedShards._fetch_shard)
    _stage(area, fill).close()
    assert (fill.calls, hashes[0]) == (1, 0)
    monkeypatch.setattr(staging, "_CHECKED", {})  # another process of the node: the mark says
    _stage(area, fill).close()
    assert (fill.calls, hashes[0]) == (1, 0)
    path = area.path_of("fp", "shard.tar")
    os.removexattr(path, staging._MARK)  # a copy staged before marks (or without xattrs)
    monkeypatch.setattr(staging, "_CHECKED", {})
    _stage(area, fill).close()
    _stage(area, fill).close()
    assert (fill.calls, hashes[0]) == (1, 1)  # hashed once, then marked


@pytest.mark.parametrize("damage", ["flipped", "flipped-unmarked", "symlink", "truncated", "not-ours"])
def test_a_damaged_copy_is_deleted_and_fetched_again(tmp_path, hashes, monkeypatch, caplog, damage):
    area, fill = StagingArea(str(tmp_path)), _Fills()
    _stage(area, fill).close()
    path = area.path_of("fp", "shard.tar")
    other = area.stage("fp", "other.tar", produce=lambda: bytes(len(DATA)))  # same size
    other.close()
    if damage.startswith("flipped"):
        if damage == "flipped-unmarked":
            os.removexattr(path, staging._MARK)
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(bytes(64))
    elif damage == "symlink":
        os.unlink(path)
        os.symlink(other.path, path)
    elif damage == "truncated":
        os.truncate(path, 1000)
    else:
        os.chown(path, 65534, 65534)
    monkeypatch.setattr(staging, "_CHECKED", {})  # a later process
    with caplog.at_level(logging.WARNING, logger="stallfree.storage.staging"):
        with _stage(area, fill) as staged:
            assert open(staged.path, "rb").read() == DATA
    assert fill.calls == 2
    assert f"staged copy {path} is damaged" in caplog.text
    assert not os.path.islink(path) and open(other.path, "rb").read() == bytes(len(DATA))


def test_a_sidecar_written_to_after_it_was_staged_is_fetched_again(tmp_path, caplog):
    area = StagingArea(str(tmp_path))
    calls = []

    def produce():
        calls.append(1)
        return b"sums" * 10

    area.stage("fp", "a.sums", produce=produce).close()
    with open(area.path_of("fp", "a.sums"), "r+b") as f:
        f.write(b"SUMS")
    with area.stage("fp", "a.sums", produce=produce) as staged:
        assert open(staged.path, "rb").read() == b"sums" * 10
    assert len(calls) == 2 and "written to after it was staged" in caplog.text


def test_a_sidecar_without_the_record_of_its_fetch_is_fetched_again(tmp_path, monkeypatch, caplog):
    """No digest and no mark (its xattr lost, or a file system without them): a sidecar cut
    short was trusted by every later process, each failing on it; it is fetched again."""
    area = StagingArea(str(tmp_path))
    calls = []

    def produce():
        calls.append(1)
        return b"sums" * 10

    area.stage("fp", "a.sums", produce=produce).close()
    path = area.path_of("fp", "a.sums")
    os.removexattr(path, staging._MARK)
    os.truncate(path, 7)
    monkeypatch.setattr(staging, "_CHECKED", {})  # a later process
    with area.stage("fp", "a.sums", produce=produce) as staged:
        assert open(staged.path, "rb").read() == b"sums" * 10
    assert len(calls) == 2 and "no record of its fetch" in caplog.text
    with area.stage("fp", "a.sums", produce=produce):  # fetched here: not again
        pass
    assert len(calls) == 2


class _SlowFill:
    """Stages ``name`` (``size`` bytes of b"a") in a thread whose fill waits for ``go``; returns
    once its room is reserved and its partial file made. ``join`` reports what it raised."""

    def __init__(self, area: StagingArea, name: str, size: int) -> None:
        self.started, self.go, self.errors = threading.Event(), threading.Event(), []

        def slow_fill(f):
            self.started.set()
            self.go.wait(60)
            f.write(b"a" * size)

        def run():
            try:
                area.stage("fp", name, slow_fill, size=size).close()
            except Exception as exc:  # noqa: BLE001 - reported by join
                self.errors.append(exc)

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.started.wait(60)

    def join(self) -> list[Exception]:
        self.thread.join(60)
        return self.errors


def test_a_file_being_written_counts_against_the_cap(tmp_path):
    """The partial file is sized to its full length when its room is reserved: a second fetch
    that would pass the cap meanwhile is refused, though the first has written nothing yet."""
    area = StagingArea(str(tmp_path), cap_bytes=1500)
    fill = _SlowFill(area, "a", 1000)
    assert area.staged_bytes() == 1000  # counted before a byte of it is written
    with pytest.raises(
        StagingFullError, match=r"no room to stage .*fp/b \(1000 bytes\) under the cap of 1500"
    ):
        area.stage("fp", "b", produce=lambda: b"b" * 1000)
    fill.go.set()
    assert not fill.join() and area.staged_bytes() == 1000
    with area.stage("fp", "b", produce=lambda: b"b" * 1000):  # "a" is not in use: evicted for it
        assert area.staged_bytes() == 1000


def test_a_file_larger_than_the_cap_is_refused_and_nothing_is_left(tmp_path):
    area = StagingArea(str(tmp_path), cap_bytes=100)
    with pytest.raises(StagingFullError, match="larger than the cap"):
        area.stage("fp", "big", produce=lambda: b"x" * 101)
    assert area.staged_bytes() == 0
    err = pickle.loads(pickle.dumps(StagingFullError("/p", 5, 4, "larger than the cap")))
    assert (err.path, err.size, err.cap, err.reason) == ("/p", 5, 4, "larger than the cap")


def test_a_failed_fill_gives_its_room_back(tmp_path):
    area = StagingArea(str(tmp_path), cap_bytes=1000)

    def failing(f):
        f.write(b"half")
        raise OSError("the store went away")

    with pytest.raises(OSError, match="the store went away"):
        area.stage("fp", "a", failing, size=800)
    assert area.staged_bytes() == 0
    with area.stage("fp", "b", produce=lambda: b"b" * 900):  # the 800 reserved were given back
        pass


def test_a_recount_never_loses_a_file_renamed_while_it_counts(tmp_path, monkeypatch):
    """A recount lists the area's names, then stats each. A fill finishing between the two
    (its partial file renamed to its name) must still be counted: counted a file short, the cap
    let one more in (a 4 MB cap held 4.04 MB in a loader run). The fill is let go right after the
    recount's listing and given time to rename before the recount stats what it listed."""
    area = StagingArea(str(tmp_path), cap_bytes=2500)
    fill = _SlowFill(area, "a", 1000)
    area.stage("fp", "b", produce=lambda: b"b" * 1000).close()  # 2000 bytes counted now
    real_scandir = os.scandir
    hooked = []

    class _Listed:
        """A directory's entries, listed at once; the fill of "a" let go before they are read."""

        def __init__(self, fd):
            with real_scandir(fd) as it:
                self.entries = list(it)
            if not hooked and any(".tmp-" in e.name for e in self.entries):
                hooked.append(True)
                fill.go.set()
                for _ in range(50):  # up to 0.5 s for "a" to be renamed (the fix keeps it waiting)
                    if os.path.exists(os.path.join(str(tmp_path), "fp", "a")):
                        break
                    threading.Event().wait(0.01)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(os, "scandir", lambda fd: _Listed(fd) if isinstance(fd, int) else real_scandir(fd))
    with area.stage("fp", "c", produce=lambda: b"c" * 1000):  # no room: a recount, then "b" goes
        monkeypatch.setattr(os, "scandir", real_scandir)
        assert not fill.join() and hooked
        names = sorted(
            n for n in os.listdir(tmp_path / "fp") if not n.endswith(".lock") and n != ".dataset.json"
        )
        assert names == ["a", "c"], names
        assert area.staged_bytes() == 2000
