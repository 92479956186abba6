"""NodeCache on real small filesystems that fill up or are read-only (tmpfs, and ext4 on a loop
device): a full or read-only tier is a miss, counted in stats and logged once per cause; never a
SIGBUS. The faults run in child processes with a timeout; the filesystems need root to mount."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from stallfree.cache import lmdbenv
from stallfree.cache.base import CacheKey
from stallfree.cache.node import NodeCache
from tests.zygote import run_python

CHILD_TIMEOUT_S = 300
WARNING = "node cache "  # how every NodeCache warning line starts


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@contextlib.contextmanager
def small_fs(root: Path, kind: str, size_mb: int) -> Iterator[Path]:
    """A freshly mounted filesystem of ``size_mb`` MiB at ``root/mnt`` (skips where mounting is not
    permitted); unmounted afterwards."""
    mnt = root / "mnt"
    mnt.mkdir()
    if kind == "tmpfs":
        done = _sh("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mnt))
    else:
        image = root / "ext4.img"
        with open(image, "wb") as f:
            f.truncate(size_mb << 20)
        made = _sh("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
        if made.returncode:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
        done = _sh("mount", "-o", "loop", str(image), str(mnt))
    if done.returncode:
        pytest.skip(f"cannot mount a {kind} here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if _sh("umount", str(mnt)).returncode:
            _sh("umount", "-l", str(mnt))


def fill(directory: Path) -> None:
    """Write a filler file until the filesystem has no byte left."""
    with open(directory / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
    assert os.statvfs(directory).f_bavail == 0


def run_child(code: str, *args: str, torch: bool = False) -> tuple[dict, list[str]]:
    """Run ``code`` in a child process; it prints one JSON line last. Returns that and the
    NodeCache warning lines of its stderr (it must exit cleanly: a SIGBUS is rc -7). A child
    that imports torch (``torch=True``: the loader's) forks from the test zygote, torch imported
    once; the others start a fresh interpreter, cheaper than a zygote child's exit."""
    if torch:
        done = run_python(textwrap.dedent(code), *args, timeout=CHILD_TIMEOUT_S)
    else:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    assert done.returncode == 0, f"child exited {done.returncode}\n{done.stderr[-4000:]}"
    warnings = [line for line in done.stderr.splitlines() if line.startswith(WARNING)]
    return json.loads(done.stdout.strip().splitlines()[-1]), warnings


# One cache object used like a training epoch: a store and a lookup per sample, values of 20 KB.
EPOCH = """
    import json, logging, sys
    from stallfree.cache.base import CacheKey
    from stallfree.cache.node import NodeCache
    logging.basicConfig(format="%(message)s")
    path, n = sys.argv[1], int(sys.argv[2])
    value = lambda i: bytes([i % 251]) * 20_000
    cache = NodeCache(path)
    key = lambda i: CacheKey("fp", i, "raw")
    first = [cache.get_many([key(i)])[0] for i in range(n)]
    for i in range(n):
        cache.put_many([(key(i), value(i))])
    again = [cache.get_many([key(i)])[0] for i in range(n)]
    stats = cache.stats()
    print(json.dumps({
        "first_misses": sum(v is None for v in first),
        "hits": [i for i, v in enumerate(again) if v is not None],
        "equal": all(v == value(i) for i, v in enumerate(again) if v is not None),
        "stats": {k: stats[k] for k in ("errors", "admitted", "puts", "rejected")},
    }))
"""


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_a_store_on_a_full_filesystem_is_a_miss(tmp_path, kind):
    with small_fs(tmp_path, kind, 8) as mnt:
        (mnt / "node").mkdir()  # (on ext4 a new directory needs a block too)
        fill(mnt)
        out, warnings = run_child(EPOCH, str(mnt / "node"), "100")
    assert out["first_misses"] == 100
    assert out["hits"] == []
    assert out["stats"]["admitted"] == 0 and out["stats"]["puts"] == 100
    assert out["stats"]["errors"] == 300  # every get and put failed: counted, each a miss
    assert len(warnings) == 1 and "filesystem is full" in warnings[0], warnings


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_a_store_that_fills_its_filesystem_keeps_what_it_wrote(tmp_path, kind):
    with small_fs(tmp_path, kind, 4) as mnt:
        out, warnings = run_child(EPOCH, str(mnt / "node"), "400")  # 8 MB into 4 MiB
    admitted = out["stats"]["admitted"]
    assert 0 < admitted < 400
    assert out["hits"] == list(range(admitted)) and out["equal"]  # the stored prefix reads back intact
    assert out["stats"]["errors"] == 400 - admitted  # each failed store counted
    assert 1 <= len(warnings) <= 3, warnings  # once per distinct cause, not once per store


LOADER = """
    import json, logging, sys
    from stallfree.cache.node import NodeCache
    from stallfree.loader.dataloader import DataLoader
    from stallfree.shards.open import open_dataset
    logging.basicConfig(format="%(message)s")
    ds = open_dataset(sys.argv[1])
    cache = NodeCache(sys.argv[2])
    loader = DataLoader(ds, batch_size=8, cache=cache, seed=1, num_workers=2,
                        collate_fn=lambda batch: [s["__key__"] for s in batch])
    epochs = [sorted(k for batch in loader for k in batch) for _ in range(2)]
    print(json.dumps({"epochs": epochs}))
"""


@pytest.mark.parametrize("when", ["full_before", "fills_during"])
def test_loader_with_workers_over_a_full_node_tier(tmp_path, when):
    writer = pytest.importorskip("stallfree.shards.writer")
    n = 120
    with writer.ShardWriter(tmp_path / "ds", format="tar", max_samples=30) as w:
        for i in range(n):
            w.write({"__key__": f"s{i:04d}", "bin": bytes([i % 251]) * 30_000})
    with small_fs(tmp_path, "tmpfs", 2) as mnt:  # 3.6 MB of samples into 2 MiB
        if when == "full_before":
            fill(mnt)
        out, _ = run_child(LOADER, str(tmp_path / "ds"), str(mnt / "node"), torch=True)
    expected = sorted(f"s{i:04d}" for i in range(n))
    assert out["epochs"] == [expected, expected]  # every sample exactly once, each epoch


# -- read-only stores ------------------------------------------------------------------------------

READONLY = """
    import json, logging, sys
    from stallfree.cache.base import CacheKey
    from stallfree.cache.node import NodeCache
    logging.basicConfig(format="%(message)s")
    path, n = sys.argv[1], int(sys.argv[2])
    value = lambda i: bytes([i % 251]) * 1000
    key = lambda i: CacheKey("fp", i, "raw")
    cache = NodeCache(path)
    got = []
    for i in range(n):  # an epoch: a lookup per sample, a store per miss
        v = cache.get_many([key(i)])[0]
        got.append(v)
        if v is None:
            cache.put_many([(key(i), value(i))])
    stats = cache.stats()
    print(json.dumps({
        "hits": [i for i, v in enumerate(got) if v is not None],
        "equal": all(v == value(i) for i, v in enumerate(got) if v is not None),
        "entries": stats.get("entries"),
        "stats": {k: stats[k] for k in ("errors", "admitted", "puts", "corrupt")},
    }))
"""


def remount_read_only(mnt: Path) -> None:
    done = _sh("mount", "-o", "remount,ro", str(mnt))
    if done.returncode:
        pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")


def test_a_read_only_store_serves_its_entries_and_logs_once(tmp_path):
    with small_fs(tmp_path, "tmpfs", 8) as mnt:
        cache = NodeCache(mnt / "node")
        cache.put_many([(CacheKey("fp", i, "raw"), bytes([i % 251]) * 1000) for i in range(40)])
        cache.close()
        remount_read_only(mnt)
        out, warnings = run_child(READONLY, str(mnt / "node"), "100")
    assert out["hits"] == list(range(40)) and out["equal"]
    assert out["entries"] == 40
    assert out["stats"]["admitted"] == 0 and out["stats"]["puts"] == 60
    assert out["stats"]["errors"] == 60  # each skipped store counted
    assert len(warnings) == 1 and "not writable" in warnings[0], warnings


def test_a_read_only_directory_without_a_store_is_a_miss_logged_once(tmp_path):
    with small_fs(tmp_path, "tmpfs", 8) as mnt:
        (mnt / "node").mkdir()
        remount_read_only(mnt)
        out, warnings = run_child(READONLY, str(mnt / "node"), "100")
    assert out["hits"] == []
    assert out["stats"]["errors"] == 200  # each of the 100 gets and 100 puts
    assert len(warnings) == 1, warnings


# -- the lock file ---------------------------------------------------------------------------------


def allocated(file: Path) -> bool:
    """Every byte of ``file`` has a block behind it (no hole a shared mapping could fault on)."""
    st = file.stat()
    return st.st_blocks * 512 >= st.st_size


def test_the_lock_file_is_fully_allocated_at_the_size_lmdb_uses(tmp_path):
    cache = NodeCache(tmp_path / "node")
    assert not cache.contains(CacheKey("fp", 0, "raw"))  # opens the store
    lock = tmp_path / "node" / "lock.mdb"
    assert allocated(lock)
    with lmdbenv.using():
        handle = lmdbenv.acquire(cache.path, cache.map_size)
        assert handle.env.max_readers() == lmdbenv._MAX_READERS  # LMDB kept the size we allocated
        lmdbenv.release(cache.path, handle)
    cache.close()


def test_a_sparse_lock_file_left_by_an_older_version_is_allocated_on_open(tmp_path):
    cache = NodeCache(tmp_path / "node")
    cache.put_many([(CacheKey("fp", 1, "raw"), b"v" * 100)])
    cache.close()
    lock = tmp_path / "node" / "lock.mdb"
    size = lock.stat().st_size
    with open(lock, "r+b") as f:  # the same size, all one hole
        f.truncate(0)
        f.truncate(size)
    if allocated(lock):
        pytest.skip("this filesystem does not make sparse files")
    cache = NodeCache(tmp_path / "node")
    assert cache.get_many([CacheKey("fp", 1, "raw")]) == [b"v" * 100]
    assert allocated(lock) and lock.stat().st_size == size
    cache.close()
