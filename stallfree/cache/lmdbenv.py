"""Process-wide LMDB environments that stay correct across ``fork``.

LMDB allows one open environment per file per process, and a forked child must neither use nor
close its parent's environment: closing it there wipes the parent's reader slots in the shared
lock file (so a writer could recycle pages a parent reader still uses), and py-lmdb refuses to
open the same files again while the inherited handle exists. So every NodeCache of a process
shares one environment per store directory (by device and inode, so two spellings of one path
share it too), and just before ``os.fork`` (DataLoader workers) the parent waits for in-flight
LMDB operations, closes its environments cleanly and reopens them lazily afterwards; the child
starts with none and opens its own.

LMDB's cross-process state rests on POSIX record locks on the lock file: a shared lock on byte 0
says "the environment is in use" (the first process to find it unlocked re-initialises the reader
table and the writer mutex) and a lock on byte ``pid`` says "process pid is alive" (``reader_check``
frees the reader slots of processes without one). The kernel drops *all* of a process's record
locks on a file when the process closes *any* descriptor of that file, so this module never opens
the lock file while its environment is open in this process: it is allocated before the open, and
where LMDB grew it during the open the environment is closed, the file allocated and opened again.

Growing the map of an open environment (a NodeCache with a larger capacity joins, or another process
grew the store beyond this process's map) must wait for a moment when this process runs no LMDB
transaction at all: ``mdb_env_set_mapsize`` replaces the memory map under every open transaction
(py-lmdb invalidates them, and a reader inside LMDB at that moment reads unmapped memory). So a grow
is only recorded where it is asked for and applied when the last in-flight operation ends; new
operations wait for it the way they wait for a fork.

No page of the store may be written through a memory map into a hole in its file: on a full
filesystem (a small ``/dev/shm``) the kernel cannot back the page and kills the process with SIGBUS,
where the cache contract wants a miss. So the data file is written with ``pwrite`` only
(``writemap=False``: a full filesystem is an error from the commit), and the lock file, which LMDB
always maps writable (its reader table), has every block allocated (``posix_fallocate``) before
LMDB maps it; where that is not possible the open fails with ``StoreUnavailable``. A store whose
directory cannot be written opens read-only: its entries still serve reads.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

log = logging.getLogger(__name__)

_DB_NAMES = (b"data", b"meta", b"atime", b"order")
_MAX_READERS = 2048
_LOCK_NAME = "lock.mdb"
# the lock file LMDB creates on Linux: its header (MDB_txninfo, three cache lines, the first reader
# slot included) and one cache line per further reader slot
_LOCK_BYTES = 3 * 64 + (_MAX_READERS - 1) * 64
_FORK_WAIT_S = 10.0
_REMAP_WAIT_S = 10.0  # an operation waits at most this long for a pending grow before going ahead


class StoreUnavailable(OSError):
    """The store cannot be opened safely here (no space to back its lock file, not readable)."""


class ReadOnlyStore(OSError):
    """A write to a store this process could open only read-only."""


@dataclass
class Handle:
    env: lmdb.Environment
    dbs: tuple[Any, ...]  # data, meta, atime, order
    generation: int
    store: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the store directory: the key in _envs
    refs: int = 0
    checked_at: float = 0.0
    want_map: int = 0  # the largest map size asked for in this process
    readonly: bool = False  # the directory is not writable: reads only
    remap: bool = False  # a grow to want_map waits for the next moment with no operation running

    def check_readers(self, every_s: float = 5.0) -> None:
        """Free reader slots of processes that died (killed workers), at most every ``every_s``:
        a stale slot would pin old pages and make the store grow without bound."""
        now = time.monotonic()
        if now - self.checked_at >= every_s:
            self.checked_at = now
            self.env.reader_check()


_cond = threading.Condition()
_active = 0
_forking = False
_generation = 0
_envs: dict[tuple[int, int], Handle] = {}
_local = threading.local()  # this thread's using() depth: a nested operation never waits for itself


@contextmanager
def using() -> Iterator[None]:
    """Hold around every LMDB operation (all its transactions inside) so that neither a fork nor a
    map grow happens while it runs."""
    global _active
    depth = getattr(_local, "depth", 0)
    deadline = time.monotonic() + _REMAP_WAIT_S
    with _cond:
        while True:
            if _forking:
                _cond.wait()
                continue
            left = deadline - time.monotonic()
            if depth or left <= 0 or not _remap_pending():
                break
            _cond.wait(left)
        _active += 1
    _local.depth = depth + 1
    try:
        yield
    except lmdb.MapResizedError:
        # another process grew the store beyond this process's map: adopt its size at the next safe point
        with _cond:
            for handle in _envs.values():
                handle.remap = True
        raise
    finally:
        _local.depth = depth
        with _cond:
            _active -= 1
            if not _active:
                _remap()
                _cond.notify_all()


def _remap_pending() -> bool:
    return any(handle.remap for handle in _envs.values())


def _remap() -> None:
    """Apply pending grows; only with ``_cond`` held and no operation of this process running."""
    for handle in _envs.values():
        if not handle.remap:
            continue
        handle.remap = False
        try:
            handle.env.set_mapsize(0)  # adopt the size the store was last grown to, by any process
            if handle.env.info()["map_size"] < handle.want_map:
                handle.env.set_mapsize(handle.want_map)
        except lmdb.Error as exc:
            log.warning(
                "cannot grow the LMDB map of %s to %d bytes: %s", handle.env.path(), handle.want_map, exc
            )


def generation() -> int:
    """Bumped whenever environments were closed for a fork: handles of older generations are stale."""
    return _generation


def acquire(path: str, map_size: int) -> Handle:
    """The process's environment for ``path`` (opened on first use); call inside ``using()``.

    An environment already open with a smaller map grows to ``map_size`` once no operation of this
    process is running (at the latest when the caller's own ``using()`` ends)."""
    with _cond:
        store = _store_id(path)
        handle = _envs.get(store)
        if handle is None:
            handle = _envs[store] = _open(path, map_size, store)
        if map_size > handle.want_map:
            handle.want_map = map_size
            # never here: other threads may be inside transactions (the caller is inside using())
            handle.remap = handle.remap or handle.env.info()["map_size"] < map_size
        handle.refs += 1
        return handle


def _store_id(path: str) -> tuple[int, int]:
    """The store directory's identity (created when missing): one environment per file per process."""
    Path(path).mkdir(parents=True, exist_ok=True)
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _open(path: str, map_size: int, store: tuple[int, int]) -> Handle:
    """Open the environment at ``path``: read-write with a fully allocated lock file, or read-only
    where the directory cannot be written."""
    lock_file = os.path.join(path, _LOCK_NAME)
    backed = _back_file(lock_file, _LOCK_BYTES)
    env = _open_env(path, map_size, writable=backed is not None)
    if backed is not None and os.stat(lock_file).st_size > backed:
        # LMDB chose a larger reader table than _LOCK_BYTES and grew the file past the allocated
        # blocks. Allocating the rest needs a descriptor of the file, and closing that would drop
        # the record locks the open environment holds: close it first, allocate, open again.
        env.close()
        backed = _back_file(lock_file, 0)
        env = _open_env(path, map_size, writable=backed is not None)
    try:
        dbs = tuple(env.open_db(n) for n in _DB_NAMES)
    except lmdb.Error as exc:
        env.close()
        raise StoreUnavailable(f"cannot open the tables of the LMDB store {path}: {exc}") from exc
    handle = Handle(env, dbs, _generation, store, readonly=backed is None)
    if backed is not None:
        handle.check_readers(0.0)  # free reader slots left by crashed processes
    return handle


def _open_env(path: str, map_size: int, *, writable: bool) -> lmdb.Environment:
    try:
        return lmdb.open(
            path,
            map_size=map_size,
            subdir=True,
            readonly=not writable,
            max_dbs=len(_DB_NAMES),
            max_readers=_MAX_READERS,
            readahead=False,
            meminit=False,
            writemap=False,  # pages go to the file by pwrite: a full filesystem fails the commit, no SIGBUS
            sync=False,  # a cache: durable across process crashes (the OS has the pages), not power loss
            metasync=False,
        )
    except lmdb.Error as exc:
        how = "read-only (the directory is not writable)" if not writable else "read-write"
        raise StoreUnavailable(f"cannot open the LMDB store {path} {how}: {exc}") from exc


def _back_file(file: str, size: int) -> int | None:
    """Allocate every block of ``file`` (created with ``size`` bytes when missing or empty; an
    existing file keeps its size, which processes that map it rely on), so writes through a shared
    memory map of it can never meet a hole the filesystem has no space for; returns the bytes
    allocated. None when the file cannot be opened for writing (read-only filesystem or
    permissions): nothing was done. Only call while this process has no environment of the file
    open: closing the descriptor used here drops every record lock the process holds on it."""
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        raise StoreUnavailable(f"cannot open {file}: {exc}") from exc
    try:
        st = os.fstat(fd)
        length = st.st_size or size
        # an already allocated file (other processes use it) is left alone: where the filesystem has
        # no fallocate, glibc emulates it by writing zero bytes, which could race their writes
        if length and not (st.st_size and st.st_blocks * 512 >= st.st_size):
            try:
                os.posix_fallocate(fd, 0, length)
            except OSError as exc:
                why = "the filesystem is full" if exc.errno == errno.ENOSPC else exc.strerror
                raise StoreUnavailable(f"cannot allocate the {length} bytes of {file}: {why}") from exc
    finally:
        os.close(fd)
    return length


def release(path: str, handle: Handle) -> None:
    """Drop one reference; the environment closes with its last user."""
    with _cond:
        current = _envs.get(handle.store)
        if current is not handle:
            return  # stale (closed for a fork) or already gone
        handle.refs -= 1
        if handle.refs <= 0 and not _active:
            del _envs[handle.store]
            handle.env.close()


def _close_all() -> None:
    global _generation
    if not _envs:
        return
    for handle in _envs.values():
        try:
            handle.env.close()
        except lmdb.Error as exc:
            log.warning("closing LMDB environment before fork: %s", exc)
    _envs.clear()
    _generation += 1


def _before_fork() -> None:
    global _forking
    _cond.acquire()
    if not _envs:
        return
    _forking = True
    deadline = time.monotonic() + _FORK_WAIT_S
    while _active and (left := deadline - time.monotonic()) > 0:
        _cond.wait(left)
    if _active:
        log.warning("forking while %d LMDB operations are still running; they will miss", _active)
    _close_all()


def _after_fork_parent() -> None:
    global _forking
    _forking = False
    _cond.notify_all()
    _cond.release()


def _after_fork_child() -> None:
    global _cond, _active, _forking, _local
    _cond = threading.Condition()  # the inherited one is held by a thread that does not exist here
    _active = 0
    _forking = False
    _local = threading.local()
    _envs.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)
