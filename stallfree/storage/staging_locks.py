"""The ``flock``s of a staging area and the descriptors that hold them.

- A reader pins a staged file with a shared ``flock`` (``StagedFile``); eviction takes an
  exclusive one without waiting, so a pinned file is never deleted (``evict_at``).
- One process of the node fetches a file, under an exclusive ``flock`` on ``<name>.lock``
  (``exclusive``); the kernel drops the lock of a process that dies, so a crashed fetcher's
  claim is taken over at once, with no pid reuse or lease timeout to judge.
- Every descriptor that holds one of these locks is closed in a forked child right after the
  fork (``Held``): a ``flock`` belongs to the open file description, which the child shares, so a
  fetcher's lock released by the parent stayed held by the child's copy, and every other process
  of the node waited on it for ever (a loader worker forked while the main process staged a
  shard: ``WorkerHungError`` after 300 s).
- Files are opened ``O_NOFOLLOW | O_NONBLOCK``: nothing of ours makes a symlink or a FIFO in the
  area, and a FIFO planted where a file belongs would block the open for ever (issue 36).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import weakref
from collections.abc import Iterator

from stallfree.storage.staging_dirs import DIR_FLAGS, StagingDirError

log = logging.getLogger(__name__)

TMP = ".tmp-"  # a partial file: ``<name>.tmp-PID-THREAD``


class Held:
    """The descriptors of this process that hold a staging ``flock``, closed in a forked child.

    The lock is taken around fork (``os.register_at_fork``), so a child never inherits a
    descriptor between its close and its removal here (its number could be reused meanwhile)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fds: set[int] = set()
        self.files: weakref.WeakSet[StagedFile] = weakref.WeakSet()

    def open(self, path: str, flags: int, mode: int = 0o600, dir_fd: int | None = None) -> int:
        # O_NONBLOCK: a FIFO in place of a staged file or a lock would block the open for ever
        # (it changes nothing for a regular file); what is opened is checked by the caller
        with self.lock:
            fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=dir_fd)
            self.fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        with self.lock:
            self.fds.discard(fd)
            os.close(fd)

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # the parent's copy still holds the lock, for as long as it means to
        self.fds = set()
        for f in list(self.files):
            f._fd = -1  # the parent's pin, not this process's: nothing to close here again


HELD = Held()
os.register_at_fork(
    before=lambda: HELD.lock.acquire(),
    after_in_parent=lambda: HELD.lock.release(),
    after_in_child=lambda: HELD.after_fork_in_child(),
)


class StagedFile:
    """A staged file, pinned (a shared ``flock``) until ``close``: never evicted while open.
    ``fd`` comes from ``HELD.open``."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd
        HELD.files.add(self)

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            HELD.close(self._fd)  # drops the pin
            self._fd = -1

    def __enter__(self) -> StagedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drop_if_orphaned(ns_fd: int, tmp: str) -> bool:
    """Delete a partial file whose writer (``...tmp-PID-THREAD``) is no longer alive; True if
    it was deleted."""
    try:
        pid = int(tmp.rsplit(TMP, 1)[1].split("-", 1)[0])
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
        return False  # still writing it
    except ProcessLookupError:
        pass
    except PermissionError:
        return False  # alive, someone else's
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=ns_fd)
    return True


def evict_at(ns_fd: int, fname: str) -> bool:
    """Delete ``fname`` unless a process pins it; True if deleted."""
    try:
        fd = HELD.open(fname, os.O_RDONLY, dir_fd=ns_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        os.unlink(fname, dir_fd=ns_fd)  # a symlink in our directory: never ours, never pinned
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # pinned: in use
            raise
        here = os.stat(fname, dir_fd=ns_fd, follow_symlinks=False)
        st = os.fstat(fd)
        if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
            return False  # replaced meanwhile by a fresh copy
        os.unlink(fname, dir_fd=ns_fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        HELD.close(fd)


def unlink_unheld_lock(ns_fd: int, name: str) -> bool:
    """Delete a fetch lock file nobody holds; False if one does."""
    try:
        fd = HELD.open(name, os.O_RDONLY, dir_fd=ns_fd)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=ns_fd)
        return True
    finally:
        HELD.close(fd)


def evict(path: str) -> bool:
    """Delete the staged file at ``path`` unless a process pins it; True if deleted."""
    parent = os.open(os.path.dirname(path), DIR_FLAGS)
    try:
        return evict_at(parent, os.path.basename(path))
    finally:
        os.close(parent)


def open_own_file(name: str, dir_fd: int, where: str) -> int:
    """``name`` (a fetch lock or the ``.room`` ledger in the checked directory ``dir_fd``,
    ``where`` on disk) opened read-write, made 0600 when missing. Nothing of ours makes anything
    else under these names, so a symbolic link, FIFO or socket found there (put there by hand) is
    deleted, with a warning, and made again; a directory is ``StagingDirError``."""
    for attempt in range(2):
        try:
            fd = HELD.open(name, os.O_CREAT | os.O_RDWR, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
        else:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            HELD.close(fd)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode) or attempt:
            raise StagingDirError(
                os.path.join(where, name), "is not a regular file (a lock or ledger of ours)"
            )
        log.warning(
            "%s is not a regular file (%s): deleting it", os.path.join(where, name), stat.filemode(st.st_mode)
        )
        with contextlib.suppress(FileNotFoundError):
            if os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == st.st_ino:
                os.unlink(name, dir_fd=dir_fd)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def exclusive(lock_name: str, dir_fd: int, where: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_name`` (blocks while another process holds it)."""
    fd = open_own_file(lock_name, dir_fd, where)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        HELD.close(fd)


__all__ = [
    "HELD",
    "TMP",
    "Held",
    "StagedFile",
    "drop_if_orphaned",
    "evict",
    "evict_at",
    "exclusive",
    "open_own_file",
    "unlink_unheld_lock",
]
