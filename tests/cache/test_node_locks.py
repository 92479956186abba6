"""NodeCache keeps LMDB's cross-process locks for as long as its store is open.

LMDB coordinates processes through POSIX record locks on ``lock.mdb``: a shared lock on byte 0 (the
environment is in use: nobody may re-initialise the reader table and writer mutex) and one on byte
``pid`` (this process is alive: its reader slots are not stale). Closing any descriptor of that file
drops them all, so these tests check the locks, and what losing them costs: another process opening
the store wiped the reader table and recycled pages a live snapshot was still reading.
"""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing as mp
import os

from stallfree.cache import lmdbenv
from stallfree.cache.base import CacheKey
from stallfree.cache.node import NodeCache

N_ENTRIES = 40
BLOB = 64 << 10  # several overflow pages per value: a recycled page shows as changed bytes


def _key(i: int) -> CacheKey:
    return CacheKey("fp", i, "raw")


def _blob(i: int, round_: int) -> bytes:
    return bytes([(i * 7 + round_) % 251]) * BLOB


def _holder(path: str, conn) -> None:
    """Open the store, use it as a worker would, then idle with it open until told to stop."""
    cache = NodeCache(path)
    cache.put_many([(_key(0), b"x")])
    assert cache.get_many([_key(0)]) == [b"x"]
    conn.send(os.getpid())
    conn.recv()
    conn.send(cache.stats()["errors"])


def _lock_is_held(file: str, offset: int) -> bool:
    """Whether some other process holds a record lock on byte ``offset`` of ``file``. Only called
    where this process has no environment of the file open (closing ``fd`` drops its locks)."""
    fd = os.open(file, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_process_with_the_store_open_holds_lmdbs_locks(tmp_path):
    path = str(tmp_path / "node")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(path, child))
    proc.start()
    try:
        assert parent.poll(60), "holder did not open the store"
        pid = parent.recv()
        lock = os.path.join(path, "lock.mdb")
        assert _lock_is_held(lock, 0), "the 'environment in use' lock was dropped"
        assert _lock_is_held(lock, pid), "the 'reader process alive' lock was dropped"
        parent.send("stop")
        assert parent.poll(30)
        assert parent.recv() == 0
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def _probe_locks(lock: str, pid: int, conn) -> None:
    conn.send((_lock_is_held(lock, 0), _lock_is_held(lock, pid)))


def test_a_lock_file_lmdb_must_grow_is_allocated_without_dropping_the_locks(tmp_path):
    """A lock file smaller than LMDB's reader table (left by a build with fewer readers) is grown by
    LMDB during the open; allocating the grown part must not cost the open environment its locks."""
    lock = tmp_path / "node" / "lock.mdb"
    lock.parent.mkdir()
    lock.write_bytes(bytes(4096))  # allocated, but smaller than the table
    cache = NodeCache(tmp_path / "node")
    cache.put_many([(_key(0), b"x")])
    assert cache.get_many([_key(0)]) == [b"x"]
    st = lock.stat()
    assert st.st_size > 4096 and st.st_blocks * 512 >= st.st_size  # grown, and every block allocated
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    probe = ctx.Process(target=_probe_locks, args=(str(lock), os.getpid(), child))
    probe.start()
    try:
        assert parent.poll(60), "probe did not report"
        assert parent.recv() == (True, True)
    finally:
        probe.join(30)
        if probe.is_alive():
            probe.kill()
    assert cache.stats()["errors"] == 0
    cache.close()


def _snapshot_reader(path: str, conn) -> None:
    """Write round 0, then read it twice inside one read transaction with another process's
    rewrites in between: a snapshot must read the same bytes throughout."""
    cache = NodeCache(path)
    for start in range(0, N_ENTRIES, 5):
        cache.put_many([(_key(i), _blob(i, 0)) for i in range(start, start + 5)])
    with lmdbenv.using():
        handle = lmdbenv.acquire(cache.path, cache.map_size)
        data = handle.dbs[0]
        with handle.env.begin(db=data) as txn:
            before = {bytes(k): hashlib.sha256(v).hexdigest() for k, v in txn.cursor()}
            conn.send(len(before))
            conn.recv()  # the other process has rewritten everything meanwhile
            try:
                after = {bytes(k): hashlib.sha256(v).hexdigest() for k, v in txn.cursor()}
                changed = sum(after.get(k) != d for k, d in before.items()) + len(
                    after.keys() - before.keys()
                )
                outcome = f"changed {changed}"
            except Exception as exc:  # a recycled branch page: MDB_PAGE_NOTFOUND / MDB_CORRUPTED
                outcome = f"{type(exc).__name__}: {exc}"
        lmdbenv.release(cache.path, handle)
    got = cache.get_many([_key(i) for i in range(N_ENTRIES)])
    conn.send((outcome, sum(g == _blob(i, 3) for i, g in enumerate(got)), cache.stats()["errors"]))


def _rewriter(path: str, conn) -> None:
    """Open the store after the reader, replace every entry three times over, report."""
    cache = NodeCache(path)
    keys = [_key(i).to_bytes() for i in range(N_ENTRIES)]
    for round_ in (1, 2, 3):
        cache.delete_encoded_many(keys)
        for start in range(0, N_ENTRIES, 5):
            cache.put_many([(_key(i), _blob(i, round_)) for i in range(start, start + 5)])
    got = cache.get_many([_key(i) for i in range(N_ENTRIES)])
    conn.send((sum(g == _blob(i, 3) for i, g in enumerate(got)), cache.stats()["errors"]))


def test_a_snapshot_survives_another_process_opening_and_rewriting_the_store(tmp_path):
    """Failed before the fix: the reader's open dropped its locks, so the rewriter's open took
    LMDB's exclusive lock, reset the reader table, and its writes reused the snapshot's pages."""
    path = str(tmp_path / "node")
    ctx = mp.get_context("spawn")
    reader_conn, reader_end = ctx.Pipe()
    writer_conn, writer_end = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_snapshot_reader, args=(path, reader_end))
    writer = ctx.Process(target=_rewriter, args=(path, writer_end))
    reader.start()
    try:
        assert reader_conn.poll(60), "reader did not write its entries"
        assert reader_conn.recv() == N_ENTRIES
        writer.start()
        assert writer_conn.poll(60), "rewriter did not finish"
        assert writer_conn.recv() == (N_ENTRIES, 0)
        reader_conn.send("go")
        assert reader_conn.poll(60), "reader did not finish"
        assert reader_conn.recv() == ("changed 0", N_ENTRIES, 0)
    finally:
        for proc in (reader, writer):
            if proc.pid is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    assert (reader.exitcode, writer.exitcode) == (0, 0)


def test_two_spellings_of_one_store_share_one_environment(tmp_path):
    """LMDB allows one environment per file per process; a symlink to the store is the same file."""
    (tmp_path / "node").mkdir()
    os.symlink(tmp_path / "node", tmp_path / "alias")
    direct, alias = NodeCache(tmp_path / "node"), NodeCache(tmp_path / "alias")
    direct.put_many([(_key(1), b"one")])
    alias.put_many([(_key(2), b"two")])
    assert direct.get_many([_key(1), _key(2)]) == [b"one", b"two"]
    assert alias.get_many([_key(1), _key(2)]) == [b"one", b"two"]
    assert (direct.stats()["errors"], alias.stats()["errors"]) == (0, 0)
    alias.close()  # the other user keeps the shared environment open
    assert direct.get_many([_key(2)]) == [b"two"]
    assert direct.stats()["errors"] == 0
    direct.close()
