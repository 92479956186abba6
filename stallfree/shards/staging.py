"""A node-local staging area: whole files of a remote dataset copied to a local directory once
per node, shared by every process of the node (a job's ranks and their loader workers).

Why: a shuffled read of a bucket sample by sample costs a GET per sample (issue 20: 1.01 GETs
per sample, 0.3x WebDataset's speed at 10 ms a round trip). Staging reads each shard in a few
large ranged GETs into a local file, and samples come from local bytes after that.

How the files are kept:

- ``<root>/<namespace>/<name>``: ``namespace`` is the dataset's fingerprint (a changed dataset
  never meets an old copy), ``name`` the file's path in the dataset with ``/`` quoted. A file
  is written to a temporary name and renamed into place, so a half-written file is never seen.
- One process of the node fetches a file; the others wait for it. The fetcher holds an
  exclusive ``flock`` on ``<name>.lock``: a waiter blocks on the same lock, then finds the file
  there. ``flock`` rather than an O_EXCL claim file with a pid in it: the kernel drops the lock
  of a process that dies, so a crashed fetcher's claim is taken over at once, with no pid reuse
  or lease timeout to judge.
- A byte cap (``cap_bytes``). A file in use is pinned: its reader holds a shared ``flock`` on
  it (``StagedFile``). Over the cap, the least recently used files (mtime, set on each use) that
  no process pins are deleted, only then: a dataset that fits stays staged, and a second epoch
  reads no remote byte.
- Every descriptor that holds one of these ``flock``s is closed in a forked child right after
  the fork (``_Held``): a ``flock`` belongs to the open file description, which the child
  shares, so a fetcher's lock released by the parent stayed held by the child's copy, and every
  other process of the node waited on it for ever (a loader worker forked while the main
  process staged a shard: ``WorkerHungError`` after 300 s).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import quote

log = logging.getLogger(__name__)

_LOCK, _TMP = ".lock", ".tmp-"
MAX_DEFAULT_CAP = 256 << 30
TRIM_EVERY = 64  # files staged by a process between two walks of the whole area


@dataclass(frozen=True)
class Staging:
    """Where and how much to stage (the loader's ``staging=`` option).

    ``root``: the directory (None: ``stallfree-staging-<uid>`` in the system's temp directory,
    one per user and node, so ranks and workers share it). ``cap_bytes``: the most it may hold
    (None: half the disk space free when first opened, at most 256 GiB). ``part_bytes`` and
    ``concurrency``: the ranged GETs a file is read in, and how many at once (8 MB, as Amazon's
    CRT client: a 16 MB shard in two GETs, so a window of 8 shards is 16 connections, where one
    connection per shard left bandwidth unused through a 10 ms round trip; RESULTS.md, Object
    storage). ``direct``: S3 parts as presigned GETs received straight into the staged file
    (``shards/s3direct.py``, where the filesystem's options allow); False: through s3fs."""

    root: str | None = None
    cap_bytes: int | None = None
    part_bytes: int = 8 << 20
    concurrency: int = 8
    direct: bool = True

    def __post_init__(self) -> None:
        if self.cap_bytes is not None and self.cap_bytes <= 0:
            raise ValueError(f"staging cap_bytes must be > 0, got {self.cap_bytes}")
        if self.part_bytes < 1 or self.concurrency < 1:
            raise ValueError(
                f"staging part_bytes and concurrency must be >= 1, got {self.part_bytes}, {self.concurrency}"
            )

    def resolved_root(self) -> str:
        return self.root or os.path.join(tempfile.gettempdir(), f"stallfree-staging-{os.getuid()}")


class _Held:
    """The descriptors of this process that hold a staging ``flock``, closed in a forked child.

    The lock is taken around fork (``os.register_at_fork``), so a child never inherits a
    descriptor between its close and its removal here (its number could be reused meanwhile)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fds: set[int] = set()
        self.files: weakref.WeakSet[StagedFile] = weakref.WeakSet()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        with self.lock:
            fd = os.open(path, flags | os.O_CLOEXEC, mode)
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


_HELD = _Held()
os.register_at_fork(
    before=lambda: _HELD.lock.acquire(),
    after_in_parent=lambda: _HELD.lock.release(),
    after_in_child=lambda: _HELD.after_fork_in_child(),
)


class StagedFile:
    """A staged file, pinned (a shared ``flock``) until ``close``: never evicted while open.
    ``fd`` comes from ``_HELD.open``."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd
        _HELD.files.add(self)

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            _HELD.close(self._fd)  # drops the pin
            self._fd = -1

    def __enter__(self) -> StagedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StagingArea:
    """The files of one staging directory (see the module docstring). Thread-safe; processes
    coordinate through the file system only."""

    def __init__(self, root: str, cap_bytes: int | None = None) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = root
        self.cap_bytes = cap_bytes if cap_bytes is not None else default_cap(root)
        self._trim_lock = threading.Lock()
        self._warned_full = False
        # bytes staged, as last counted plus what this process staged since: the whole
        # directory is walked only when that passes the cap, or every TRIM_EVERY files (other
        # processes stage too), not once per file (a walk of 100,000 files takes a while)
        self._estimate = self.staged_bytes()
        self._since_walk = 0

    def path_of(self, namespace: str, name: str) -> str:
        return os.path.join(self.root, quote(namespace, safe=""), quote(name, safe=""))

    def stage(self, namespace: str, name: str, fill: Callable[[BinaryIO], None]) -> StagedFile:
        """The staged file ``name`` of ``namespace``, pinned; ``fill(f)`` writes its content when
        no process of the node has staged it yet (exactly one of them runs it at a time). An
        exception from ``fill`` propagates, and nothing is left staged."""
        path = self.path_of(namespace, name)
        while True:
            pinned = _pin(path)
            if pinned is not None:
                return pinned
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with _exclusive(path + _LOCK):
                pinned = _pin(path)  # another process staged it while this one waited
                if pinned is not None:
                    return pinned
                pinned = self._fill(path, fill)
            self._added(pinned.size)
            return pinned

    def _fill(self, path: str, fill: Callable[[BinaryIO], None]) -> StagedFile:
        """Write ``path`` through a temporary file; returned pinned (no trim can take it first)."""
        tmp = f"{path}{_TMP}{os.getpid()}-{threading.get_ident()}"
        fd = -1
        try:
            with open(tmp, "w+b") as f:  # readable too: a fill may check what it wrote
                fill(f)
            fd = _HELD.open(tmp, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(tmp, path)  # visible whole or not at all
        except BaseException:
            if fd >= 0:
                _HELD.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + _LOCK)  # later arrivals find the file before they look for a lock
        return StagedFile(path, fd)

    def _added(self, size: int) -> None:
        with self._trim_lock:
            self._estimate += size
            self._since_walk += 1
            due = self._estimate > self.cap_bytes or self._since_walk >= TRIM_EVERY
        if due:
            self.trim()

    def staged_bytes(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[str, int, float]]:
        """(path, size, last use) of every staged file (locks and partial files aside); the
        partial files of processes that died filling them are deleted on the way."""
        out = []
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                if n.endswith(_LOCK):
                    continue
                if _TMP in n:
                    _drop_if_orphaned(os.path.join(dirpath, n))
                    continue
                p = os.path.join(dirpath, n)
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(p)
                    out.append((p, st.st_size, st.st_mtime))
        return out

    def trim(self, keep: str | None = None) -> None:
        """Delete the least recently used unpinned files until the area is within its cap."""
        with self._trim_lock:
            files = self._files()
            total = sum(size for _, size, _ in files)
            self._estimate, self._since_walk = total, 0
            if total <= self.cap_bytes:
                return
            for path, size, _ in sorted(files, key=lambda f: f[2]):
                if total <= self.cap_bytes:
                    return
                if path != keep and _evict(path):
                    total -= size
                    self._estimate -= size
            if not self._warned_full:
                self._warned_full = True
                log.warning(
                    "staging area %s holds %d bytes, over its cap of %d, all in use: raise the cap "
                    "(staging=Staging(cap_bytes=...)) to at least two shard windows",
                    self.root,
                    total,
                    self.cap_bytes,
                )


def default_cap(root: str) -> int:
    """Half the space free on ``root``'s file system, at most ``MAX_DEFAULT_CAP``."""
    return max(1, min(MAX_DEFAULT_CAP, shutil.disk_usage(root).free // 2))


def _drop_if_orphaned(tmp: str) -> None:
    """Delete a partial file whose writer (``...tmp-PID-THREAD``) is no longer alive."""
    try:
        pid = int(tmp.rsplit(_TMP, 1)[1].split("-", 1)[0])
    except ValueError:
        return
    try:
        os.kill(pid, 0)
        return  # still writing it
    except ProcessLookupError:
        pass
    except PermissionError:
        return  # alive, someone else's
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


def _pin(path: str) -> StagedFile | None:
    """``path`` opened and pinned, touched as used now; None if it is not staged."""
    try:
        fd = _HELD.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink == 0:  # evicted between open and pin
            _HELD.close(fd)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the eviction order: least recently used first
    except BaseException:
        _HELD.close(fd)
        raise
    return StagedFile(path, fd)


def _evict(path: str) -> bool:
    """Delete ``path`` unless a process pins it; True if deleted."""
    try:
        fd = _HELD.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False  # pinned: in use
            raise
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        _HELD.close(fd)


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """Hold an exclusive ``flock`` on ``lock_path`` (blocks while another process holds it)."""
    fd = _HELD.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        _HELD.close(fd)


__all__ = ["Staging", "StagedFile", "StagingArea", "default_cap"]
