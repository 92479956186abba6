"""A node-local staging area: whole files of a remote dataset copied to a local directory once
per node, shared by every process of the node (a job's ranks and their loader workers).

Why: a shuffled read of a bucket sample by sample costs a GET per sample (issue 20: 1.01 GETs
per sample, 0.3x WebDataset's speed at 10 ms a round trip). Staging reads each shard in a few
large ranged GETs into a local file, and samples come from local bytes after that.

How the files are kept:

- ``<root>/<namespace>/<name>``: ``namespace`` is the dataset's fingerprint (a changed dataset
  never meets an old copy), ``name`` the file's path in the dataset with ``/`` quoted. A file
  is written to a temporary name and renamed into place, so a half-written file is never seen.
  ``<namespace>/.dataset.json`` says which dataset URL the namespace holds (``stallfree
  staging list``).
- Private to its user (issue 36): the default root, ``stallfree-staging-<uid>`` in the temp
  directory, is a name anyone can guess, so it and every namespace directory are checked before
  use (``os.lstat`` and ``fstat`` of an ``O_NOFOLLOW | O_DIRECTORY`` descriptor: a directory, not
  a symbolic link, owned by this user, writable by no one else) and a failed check is a
  ``StagingDirError`` naming the path and the problem. Refused rather than replaced by a fresh
  private ``mkdtemp`` root: a per-process root would end the node-wide sharing (every worker and
  rank fetching every shard, the cap counted per process, a root nobody finds again to clear),
  and a directory planted under our name is something its user should hear about. Directories
  are made 0700, files 0600; every operation inside the root goes through the checked
  descriptors (``dir_fd``), so a symlink swapped in later is never followed.
- One process of the node fetches a file; the others wait for it. The fetcher holds an
  exclusive ``flock`` on ``<name>.lock``: a waiter blocks on the same lock, then finds the file
  there. ``flock`` rather than an O_EXCL claim file with a pid in it: the kernel drops the lock
  of a process that dies, so a crashed fetcher's claim is taken over at once, with no pid reuse
  or lease timeout to judge.
- A copy found staged (by an earlier run, another process, anyone) is checked before this
  process first uses it (``Expected``): a regular file of this user, the manifest's size, and
  the manifest's digest. The digest is taken once per node and copy: it is then recorded on the
  file (an extended attribute with the file's inode, size and mtime, which any write changes),
  so a later process checks that record instead of hashing the file again; a file system
  without extended attributes hashes once per process. A damaged copy is deleted, with a
  warning naming it, and fetched again. A copy this process fetched was checked as it was
  fetched, and is not hashed again. Last use is the file's atime (set on each use), so the
  mtime stays the time of its last write.
- A byte cap (``cap_bytes``) that holds at every moment, counting files being written: room is
  reserved under an exclusive ``flock`` on ``<root>/.room`` (which keeps the node's running
  total, recounted from the directory now and then and whenever it says there is no room)
  before a file is created, and the partial file is sized to its full length at once, so every
  process counts it; it is renamed to its name under that lock too, so a recount sees it under
  one name or the other. Making room deletes the least recently used files that no process pins
  (a reader holds a shared ``flock`` on a file it uses: ``StagedFile``). When the pinned files
  leave no room, ``stage`` raises ``StagingFullError`` rather than wait for a pin to go (a
  process waiting with pins of its own could wait for ever); the reader then reads that shard
  with ranged GETs instead (``staged_reads.py``).
- Every descriptor that holds one of these ``flock``s is closed in a forked child right after
  the fork (``_Held``): a ``flock`` belongs to the open file description, which the child
  shares, so a fetcher's lock released by the parent stayed held by the child's copy, and every
  other process of the node waited on it for ever (a loader worker forked while the main
  process staged a shard: ``WorkerHungError`` after 300 s).

The parts with a job of their own live beside this module: ``staging_dirs.py`` (the directory
checks), ``staging_locks.py`` (the ``flock``s and the descriptors holding them),
``staging_checks.py`` (whether a copy found staged may be reused) and ``staging_room.py`` (the
cap's ledger). This module is the area itself: where files go, staging one, walking and
evicting.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import quote, urlsplit, urlunsplit

from stallfree.storage import digests, staging_checks
from stallfree.storage.staging_checks import ABSENT as _ABSENT
from stallfree.storage.staging_checks import MARK as _MARK  # noqa: F401 - named by tests and a benchmark
from stallfree.storage.staging_checks import OK as _OK
from stallfree.storage.staging_checks import UNCHECKED as _UNCHECKED
from stallfree.storage.staging_checks import Expected
from stallfree.storage.staging_dirs import StagingDirError, open_private_dir
from stallfree.storage.staging_dirs import open_checked_dir as _open_checked_dir
from stallfree.storage.staging_locks import HELD as _HELD
from stallfree.storage.staging_locks import TMP as _TMP
from stallfree.storage.staging_locks import StagedFile
from stallfree.storage.staging_locks import drop_if_orphaned as _drop_if_orphaned
from stallfree.storage.staging_locks import evict as _evict  # noqa: F401 - named by tests
from stallfree.storage.staging_locks import evict_at as _evict_at
from stallfree.storage.staging_locks import exclusive as _exclusive
from stallfree.storage.staging_locks import open_own_file as _open_own_file
from stallfree.storage.staging_locks import unlink_unheld_lock as _unlink_unheld_lock
from stallfree.storage.staging_room import (
    MAX_DEFAULT_CAP,
    RECOUNT_EVERY,
    ROOM_FILE,
    StagingFullError,
    default_cap,
)
from stallfree.storage.staging_room import Ledger as _Ledger

log = logging.getLogger(__name__)

_LOCK = ".lock"
NOTE_FILE = ".dataset.json"  # in a namespace: which dataset it holds

# copies this process checked or fetched: (st_dev, st_ino, st_size, st_mtime_ns) -> digest
_CHECKED: dict[tuple[int, int, int, int], str | None] = {}


def _judge(fd: int, st: os.stat_result, expect: Expected) -> str:
    """``staging_checks.judge`` against this process's memory of checked copies."""
    return staging_checks.judge(fd, st, expect, _CHECKED)


def _record(fd: int, st: os.stat_result, expect: Expected) -> None:
    """Note a checked copy (this process's memory, and the file's mark for the node's others)."""
    staging_checks.record(fd, st, expect, _CHECKED)


@dataclass(frozen=True)
class Staging:
    """Where and how much to stage (the loader's ``staging=`` option).

    ``root``: the directory (None: ``stallfree-staging-<uid>`` in the system's temp directory,
    one per user and node, so ranks and workers share it; it must be this user's and writable by
    no one else: ``StagingDirError``). ``cap_bytes``: the most it may hold at any moment (None:
    half the disk space free when first opened, at most 256 GiB). ``part_bytes`` and
    ``concurrency``: the ranged GETs a file is read in, and how many at once (8 MB, as Amazon's
    CRT client: a 16 MB shard in two GETs, so a window of 8 shards is 16 connections, where one
    connection per shard left bandwidth unused through a 10 ms round trip; RESULTS.md, Object
    storage). ``direct``: S3 parts as presigned GETs received straight into the staged file
    (``storage/s3direct.py``, where the filesystem's options allow); False: through s3fs."""

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
        return self.root or default_root()


def default_root() -> str:
    """``stallfree-staging-<uid>`` in the system's temp directory."""
    return os.path.join(tempfile.gettempdir(), f"stallfree-staging-{os.getuid()}")


@dataclass(frozen=True)
class StagedEntry:
    """One file of the area as a walk found it (``path`` relative names kept for ``dir_fd`` use)."""

    namespace: str  # the directory's name, quoted as on disk
    name: str  # the file's name, quoted as on disk
    size: int
    last_use_ns: int  # atime: set on each use
    partial: bool  # a file being written (``<name>.tmp-PID-THREAD``)


class StagingArea:
    """The files of one staging directory (see the module docstring). Thread-safe; processes
    coordinate through the file system only. ``close`` releases its directory descriptors."""

    def __init__(self, root: str, cap_bytes: int | None = None, create: bool = True) -> None:
        self.root = os.path.abspath(root)
        self._root_fd = open_private_dir(self.root, create=create)
        self._ns_fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_fds, self._ns_fds, [self._root_fd])
        self.cap_bytes = cap_bytes if cap_bytes is not None else default_cap(self.root)

    def close(self) -> None:
        self._finalizer()

    def path_of(self, namespace: str, name: str) -> str:
        return os.path.join(self.root, quote(namespace, safe=""), quote(name, safe=""))

    # -- directories --------------------------------------------------------------------------

    def namespace_fd(self, namespace: str, create: bool = True) -> int:
        """The checked descriptor of ``namespace``'s directory (made 0700 when missing); raises
        ``StagingDirError`` for one that is not safe, FileNotFoundError without ``create``."""
        return self._namespace_fd(quote(namespace, safe=""), create)

    def _namespace_fd(self, q: str, create: bool) -> int:
        with self._lock:
            fd = self._ns_fds.pop(q, None)
            if fd is not None:
                if os.fstat(fd).st_nlink > 0:  # not removed since (``staging clear``)
                    self._ns_fds[q] = fd
                    return fd
                os.close(fd)
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(q, 0o700, dir_fd=self._root_fd)
            fd = _open_checked_dir(q, os.path.join(self.root, q), dir_fd=self._root_fd)
            self._ns_fds[q] = fd
            return fd

    def note(self, namespace: str, url: str) -> None:
        """Record (once) which dataset ``namespace`` holds, for ``stallfree staging list``: its
        URL without credentials or query."""
        ns_fd = self.namespace_fd(namespace)
        with contextlib.suppress(FileNotFoundError):
            os.stat(NOTE_FILE, dir_fd=ns_fd, follow_symlinks=False)
            return
        body = json.dumps({"fingerprint": namespace, "url": _public_url(url), "created": time.time()})
        tmp = f"{NOTE_FILE}{_TMP}{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(
                tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=ns_fd
            )
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.rename(tmp, NOTE_FILE, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
        except OSError:  # a note is a convenience: a full disk must not fail a read
            log.debug("could not write %s's note", namespace, exc_info=True)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=ns_fd)

    # -- staging ------------------------------------------------------------------------------

    def stage(
        self,
        namespace: str,
        name: str,
        fill: Callable[[BinaryIO], None] | None = None,
        *,
        size: int | None = None,
        expect: Expected | None = None,
        produce: Callable[[], bytes] | None = None,
    ) -> StagedFile:
        """The staged file ``name`` of ``namespace``, pinned.

        Found staged, it is checked against ``expect`` first (see the module docstring); a
        damaged copy is deleted and fetched again. Not staged, one process of the node fetches
        it: ``fill(f)`` writes its ``size`` bytes (room for them is made first, under the cap:
        ``StagingFullError`` when the files in use leave none) and checks them against
        ``expect``'s digest itself (so they are not hashed twice). Where the size is only known
        once fetched (a small sidecar), pass ``produce`` instead: its bytes are written. An
        exception from ``fill`` or ``produce`` propagates, and nothing is left staged."""
        if (produce is None) == (fill is None) or (fill is not None) != (size is not None):
            raise ValueError("stage: pass fill= with size=, or produce= alone")
        expect = expect or Expected(size=size)
        try:
            return self._stage(namespace, name, fill, size, expect, produce)
        except FileNotFoundError:
            # its directory removed meanwhile (``stallfree staging clear``, a namespace that had
            # emptied): once more, in a fresh one
            if not self._removed(namespace):
                raise
            return self._stage(namespace, name, fill, size, expect, produce)

    def _removed(self, namespace: str) -> bool:
        """True if the directory this area holds open for ``namespace`` was removed."""
        with self._lock:
            fd = self._ns_fds.get(quote(namespace, safe=""))
            return fd is not None and os.fstat(fd).st_nlink == 0

    def _stage(
        self,
        namespace: str,
        name: str,
        fill: Callable[[BinaryIO], None] | None,
        size: int | None,
        expect: Expected,
        produce: Callable[[], bytes] | None,
    ) -> StagedFile:
        ns_fd = self.namespace_fd(namespace)
        fname = quote(name, safe="")
        path = os.path.join(self.root, quote(namespace, safe=""), fname)
        pinned, verdict = self._pin(ns_fd, fname, path, expect)
        if verdict == _OK:
            return pinned
        if pinned is not None:
            pinned.close()
        with _exclusive(fname + _LOCK, ns_fd, os.path.dirname(path)):
            # another process may have fetched, checked or replaced it while this one waited
            pinned, verdict = self._pin(ns_fd, fname, path, expect)
            if verdict == _UNCHECKED:
                verdict = self._hash(pinned, expect)
            if verdict == _OK:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(fname + _LOCK, dir_fd=ns_fd)  # as a fill does: no lock files pile up
                return pinned
            if pinned is not None:
                pinned.close()
            if verdict != _ABSENT:
                log.warning(
                    "staged copy %s is damaged (%s): deleting it and fetching it again", path, verdict
                )
                self._discard(ns_fd, fname, path)
            if produce is not None:
                data = produce()
                return self._fill(ns_fd, fname, path, len(data), lambda f: f.write(data), expect)
            assert fill is not None and size is not None
            return self._fill(ns_fd, fname, path, size, fill, expect)

    def _pin(self, ns_fd: int, fname: str, path: str, expect: Expected) -> tuple[StagedFile | None, str]:
        """``fname`` opened, pinned and touched as used now, and what is known of it: ``_OK``
        (checked), ``_UNCHECKED`` (its digest must be taken), ``_ABSENT``, or what is wrong."""
        try:
            fd = _HELD.open(fname, os.O_RDONLY, dir_fd=ns_fd)
        except FileNotFoundError:
            return None, _ABSENT
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None, "a symbolic link, not a file"
            if exc.errno == errno.ENXIO:
                return None, "a socket, not a file"
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            if st.st_nlink == 0:  # evicted between open and pin
                _HELD.close(fd)
                return None, _ABSENT
            with contextlib.suppress(OSError):  # the eviction order: least recently used first
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
        except BaseException:
            _HELD.close(fd)
            raise
        pinned = StagedFile(path, fd)
        return pinned, _judge(fd, st, expect)

    def _hash(self, pinned: StagedFile, expect: Expected) -> str:
        """Take the pinned copy's digest: ``_OK`` (and recorded on it) or what is wrong."""
        fd = pinned._fd
        st = os.fstat(fd)
        digest = expect.hasher()
        digests.update_from_fd(digest, fd, st.st_size)
        got = digest.hexdigest()
        if got != expect.digest:
            return f"its {expect.algorithm} is {got}, the manifest records {expect.digest}"
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)  # staged before copies were private
        _record(fd, st, expect)
        return _OK

    def _fill(
        self, ns_fd: int, fname: str, path: str, size: int, fill: Callable[[BinaryIO], None], expect: Expected
    ) -> StagedFile:
        """Write ``fname`` through a temporary file, in room reserved for it; returned pinned
        (no eviction can take it first)."""
        tmp = f"{fname}{_TMP}{os.getpid()}-{threading.get_ident()}"
        wfd = self._reserve(ns_fd, tmp, size, path)
        fd = -1
        try:
            with os.fdopen(wfd, "w+b") as f:  # readable too: a fill checks what it wrote
                fill(f)
                f.flush()
                st = os.fstat(f.fileno())
                if st.st_size != size:
                    raise OSError(errno.EIO, f"staging {path}: {st.st_size} bytes written, {size} reserved")
                _record(f.fileno(), st, expect)
            fd = _HELD.open(tmp, os.O_RDONLY, dir_fd=ns_fd)
            fcntl.flock(fd, fcntl.LOCK_SH)
            # under the room lock: a recount lists the names, then stats each; renamed between
            # the two, the file was under neither name and the count came out a file short, so
            # the cap let one more in (a 4 MB cap held 4.04 MB)
            with self._room():
                os.rename(tmp, fname, src_dir_fd=ns_fd, dst_dir_fd=ns_fd)  # visible whole or not at all
        except BaseException:
            if fd >= 0:
                _HELD.close(fd)
            with self._room() as room:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=ns_fd)
                    room.total -= size
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fname + _LOCK, dir_fd=ns_fd)  # later arrivals find the file before a lock
        return StagedFile(path, fd)

    # -- the cap ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _room(self) -> Iterator[_Ledger]:
        """The node's running total of staged bytes, under the area's exclusive lock."""
        fd = _open_own_file(ROOM_FILE, self._root_fd, self.root)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            ledger = _Ledger.read(fd)
            yield ledger
            ledger.write(fd)
        finally:
            _HELD.close(fd)

    def _reserve(self, ns_fd: int, tmp: str, size: int, path: str) -> int:
        """Make room for ``size`` bytes and create the partial file ``tmp`` at that size (so every
        walk counts it); returns its descriptor, open for writing."""
        if size > self.cap_bytes:
            raise StagingFullError(path, size, self.cap_bytes, "larger than the cap")
        with self._room() as room:
            if room.total is None or room.since_walk >= RECOUNT_EVERY or room.total + size > self.cap_bytes:
                self._make_room(room, size)
            if room.total + size > self.cap_bytes:
                raise StagingFullError(
                    path,
                    size,
                    self.cap_bytes,
                    f"{room.total} bytes staged are in use (pinned) or being written",
                )
            fd = os.open(
                tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=ns_fd
            )
            try:
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=ns_fd)
                raise
            room.total += size
            room.since_walk += 1
        return fd

    def _make_room(self, room: _Ledger, size: int) -> None:
        """Under the room lock: recount the area, then delete least recently used unpinned
        files until ``size`` more bytes fit (as many as can go)."""
        entries = self.entries()
        room.total, room.since_walk = sum(e.size for e in entries), 0
        for e in sorted((e for e in entries if not e.partial), key=lambda e: e.last_use_ns):
            if room.total + size <= self.cap_bytes:
                return
            with contextlib.suppress(FileNotFoundError, StagingDirError):
                if _evict_at(self._namespace_fd(e.namespace, create=False), e.name):
                    room.total -= e.size

    def _discard(self, ns_fd: int, fname: str, path: str) -> None:
        """Delete a damaged copy (pinned or not: every reader checks a copy before using it)."""
        with self._room() as room:
            try:
                st = os.stat(fname, dir_fd=ns_fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise StagingDirError(path, "is a directory where a staged file belongs")
                os.unlink(fname, dir_fd=ns_fd)
            except FileNotFoundError:
                return
            if room.total is not None and stat.S_ISREG(st.st_mode):
                room.total -= st.st_size

    def namespaces(self) -> list[str]:
        """The namespace directories' names, as on disk (quoted)."""
        with os.scandir(self._root_fd) as top:
            return sorted(e.name for e in top if e.is_dir(follow_symlinks=False))

    def read_note(self, quoted_namespace: str) -> dict[str, object]:
        """The namespace's note (``note``), or {} if it has none or it does not parse (a note
        is at most 64 KiB of JSON: read as data, never trusted further)."""
        try:
            ns_fd = self._namespace_fd(quoted_namespace, create=False)
            fd = os.open(NOTE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=ns_fd)
        except (OSError, StagingDirError):
            return {}
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {}  # a FIFO would block the read, a device would never end
            raw = os.read(fd, 64 << 10)
        finally:
            os.close(fd)
        try:
            note = json.loads(raw)
        except (ValueError, RecursionError):  # a note is advice: one that does not parse is none
            return {}
        return note if isinstance(note, dict) else {}

    def entries(self, sweep: bool = True, only: str | None = None) -> list[StagedEntry]:
        """Every file of the area (partial ones too; locks and notes aside), or of the
        namespace ``only`` (as on disk); with ``sweep``, partial files whose writers died are
        deleted on the way."""
        out: list[StagedEntry] = []
        for q in [only] if only is not None else self.namespaces():
            try:
                ns_fd = self._namespace_fd(q, create=False)
            except (FileNotFoundError, StagingDirError):
                continue
            with os.scandir(ns_fd) as it:
                for e in it:
                    n = e.name
                    if n.endswith(_LOCK) or n == NOTE_FILE or n.startswith(NOTE_FILE + _TMP):
                        continue
                    if e.is_dir(follow_symlinks=False):
                        continue  # nothing of ours; never counted, never evicted
                    partial = _TMP in n
                    if partial and sweep and _drop_if_orphaned(ns_fd, n):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out.append(StagedEntry(q, n, st.st_size, st.st_atime_ns, partial))
        return out

    def staged_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def trim(self) -> None:
        """Delete least recently used unpinned files until the area is within its cap, and
        recount it (partial files of writers that died go too)."""
        with self._room() as room:
            self._make_room(room, 0)

    def evict(self, quoted_namespace: str, fname: str) -> bool:
        """Delete one staged file (names as on disk) unless a process pins it; True if deleted."""
        try:
            ns_fd = self._namespace_fd(quoted_namespace, create=False)
        except FileNotFoundError:
            return False
        with self._room() as room:
            try:
                size = os.stat(fname, dir_fd=ns_fd, follow_symlinks=False).st_size
            except FileNotFoundError:
                return False
            if not _evict_at(ns_fd, fname):
                return False
            if room.total is not None:
                room.total -= size
            return True

    def remove_namespace_if_empty(self, quoted_namespace: str) -> bool:
        """Remove a namespace directory that holds no staged or partial file any more: its
        note and the fetch locks nobody holds go first. True if removed."""
        try:
            ns_fd = self._namespace_fd(quoted_namespace, create=False)
        except FileNotFoundError:
            return False
        with os.scandir(ns_fd) as it:
            names = [e.name for e in it]
        if any(not (n.endswith(_LOCK) or n == NOTE_FILE) for n in names):
            return False
        for n in names:
            if n.endswith(_LOCK) and not _unlink_unheld_lock(ns_fd, n):
                return False  # a fetch is on its way
        with contextlib.suppress(FileNotFoundError):
            os.unlink(NOTE_FILE, dir_fd=ns_fd)
        try:
            os.rmdir(quoted_namespace, dir_fd=self._root_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return False  # a file staged meanwhile
            raise
        return True


def _close_fds(ns_fds: dict[str, int], others: list[int]) -> None:
    for fd in list(ns_fds.values()) + others:
        with contextlib.suppress(OSError):
            os.close(fd)
    ns_fds.clear()


def _public_url(url: str) -> str:
    """``url`` without user, password, query or fragment (what may be written to a note)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if not parts.scheme or not parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


__all__ = [
    "MAX_DEFAULT_CAP",
    "NOTE_FILE",
    "RECOUNT_EVERY",
    "ROOM_FILE",
    "Expected",
    "Staging",
    "StagedEntry",
    "StagedFile",
    "StagingArea",
    "StagingDirError",
    "StagingFullError",
    "default_cap",
    "default_root",
    "open_private_dir",
]
