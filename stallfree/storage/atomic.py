"""Write a file under a temporary name and rename it into place, so a crash or an exception never
leaves a half-written file under its final name. Hashes (sha256) and counts bytes as they go.

Local paths use plain ``open``/``os.replace`` (atomic on POSIX). Object stores write the temp object,
copy it to the final name on the server (the final object appears whole or not at all), then delete
the temp best-effort: once the copy is in place the write has succeeded, and a temp that could not
be deleted is only a hidden leftover for ``remove_stale_temps``. Other fsspec filesystems ``mv``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import fsspec

from stallfree.errors import WriteError
from stallfree.storage.digests import ShardDigests
from stallfree.storage.fs import is_local, is_object_store

log = logging.getLogger(__name__)


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "_"


def temp_name(path: str) -> str:
    """A hidden sibling of ``path``: same directory (same filesystem, so rename is cheap).

    ``.NAME.tmp-HOST-PID-RANDOM``: the writer's host and process id are in the name so that a
    later run can tell the leftovers of a killed writer from the files of a live one
    (``remove_stale_temps``)."""
    head, tail = posixpath.split(path)
    return posixpath.join(head, f".{tail}.tmp-{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?:(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-)?[0-9a-f]{12}$")
FOREIGN_TEMP_AGE_S = 24 * 3600.0  # a temp file of another host (or an unmarked one) is stale after this


@dataclass(frozen=True)
class TempFile:
    """A temp file of ours found in a directory: who wrote it (None when the name does not say)."""

    path: str
    host: str | None
    pid: int | None


def parse_temp(path: str) -> TempFile | None:
    """The ``TempFile`` for a path named by ``temp_name`` (or the older ``.NAME.tmp-RANDOM``)."""
    m = _TEMP.match(posixpath.basename(path))
    if m is None:
        return None
    return TempFile(path, m["host"], int(m["pid"]) if m["pid"] else None)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host is running (a zombie, dead but not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc here: kill(0) is all we know


def _is_stale(fs: fsspec.AbstractFileSystem, temp: TempFile, now: float, max_age_s: float) -> bool:
    """A writer on this host that is gone, or (another host's, or an unmarked name) an old file."""
    if temp.host == _host_tag() and temp.pid is not None:
        return not _pid_alive(temp.pid)
    try:
        modified = fs.modified(temp.path).timestamp()
    except Exception:  # noqa: BLE001 - no modification time here: cannot tell, so keep it
        return False
    return now - modified > max_age_s


def remove_stale_temps(
    fs: fsspec.AbstractFileSystem, directory: str, *, max_age_s: float = FOREIGN_TEMP_AGE_S
) -> list[str]:
    """Remove temp files that a dead writer (one killed before it could clean up) left in
    ``directory``; returns their paths. Only names ``temp_name`` makes are considered, and a
    temp file of a live process on this host is never touched (another writer may be running)."""
    try:
        names = fs.ls(directory, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    now = time.time()
    for name in names:
        temp = parse_temp(name)
        if temp is None or not _is_stale(fs, temp, now, max_age_s):
            continue
        try:
            fs.rm_file(temp.path)
        except FileNotFoundError:
            continue
        except Exception as exc:  # noqa: BLE001 - a leftover is clutter, not a reason to fail
            log.warning("could not remove stale temporary file %s: %s", temp.path, exc)
            continue
        log.info("removed %s, left by a writer that is gone", temp.path)
        removed.append(temp.path)
    return removed


_W = TypeVar("_W", bound="CommitOnExit")


class CommitOnExit:
    """Context-manager behaviour shared by the shard writers: ``close()`` (commit) on a clean exit,
    ``abort()`` on an exception, so nothing half-written ever appears under a final name."""

    def close(self) -> Any:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class AtomicFile:
    """A binary file being written under a temp name: ``write``, then ``commit`` or ``abort``."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, *, shard: str | None = None) -> None:
        self.fs = fs
        self.path = path
        self.tmp = temp_name(path)
        self.size = 0
        self._sha = ShardDigests()  # sha256 and xxh3-128 of every byte written
        self._shard = shard or posixpath.basename(path)
        self._done = False
        try:
            parent = posixpath.dirname(path)
            if is_local(fs):
                if parent:
                    os.makedirs(parent, exist_ok=True)
                self._f: IO[bytes] = self._open_local()
            else:
                if parent and not is_object_store(fs):
                    with contextlib.suppress(Exception):
                        fs.makedirs(parent, exist_ok=True)
                self._f = fs.open(self.tmp, "wb")
        except Exception as exc:  # noqa: BLE001 - any backend error means "cannot write here"
            raise WriteError(f"cannot write {path}: {type(exc).__name__}: {exc}", shard=self._shard) from exc

    def _open_local(self) -> IO[bytes]:
        return open(self.tmp, "wb", buffering=1 << 20)  # noqa: SIM115 - closed by commit/abort

    def write_parts(self, parts: Sequence[bytes]) -> None:
        """Write several pieces in order (a tar member's header, data and padding)."""
        for part in parts:
            self.write(part)

    def write(self, data: bytes | memoryview) -> None:
        try:
            self._f.write(data)
        except Exception as exc:  # noqa: BLE001
            raise self._failed("write failed", exc, offset=self.size) from exc
        self._sha.update(data)
        self.size += len(data)

    def sha256(self) -> str:
        return self._sha.sha256()

    def xxh3_128(self) -> str:
        """The fast digest of the same bytes (digests.py); ``sha256()`` first where it overlaps."""
        return self._sha.xxh3_128()

    def commit(self) -> None:
        """Close and rename (object stores: copy) into place; on failure the temp file is removed and
        WriteError raised."""
        if self._done:
            return
        try:
            self._f.close()
            if is_local(self.fs):
                os.replace(self.tmp, self.path)
            elif is_object_store(self.fs):
                self.fs.cp_file(self.tmp, self.path)  # server-side copy: whole or not at all
            else:
                self.fs.mv(self.tmp, self.path)
        except Exception as exc:  # noqa: BLE001
            raise self._failed(f"cannot finish {self.path}", exc) from exc
        self._done = True
        if is_object_store(self.fs):
            self._drop_temp_after_copy()

    def _drop_temp_after_copy(self) -> None:
        """Remove the temp object once its copy is in place. Best effort: the final object is whole
        and committed, so a failed delete leaves only a hidden stale temp (``remove_stale_temps``
        of a later run removes it), not a failed write."""
        try:
            self.fs.rm_file(self.tmp)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - clutter, not a reason to fail a committed write
            log.warning(
                "%s is committed, but its temporary object %s could not be removed (%s: %s); "
                "a later write to this prefix removes it",
                self.path,
                self.tmp,
                type(exc).__name__,
                exc,
            )

    def _failed(self, what: str, exc: BaseException, offset: int | None = None) -> WriteError:
        """Drop the temp file and return the error to raise (``what: ExcType: message``)."""
        self.abort()
        return WriteError(f"{what}: {type(exc).__name__}: {exc}", shard=self._shard, offset=offset)

    def abort(self) -> None:
        """Drop the temp file; never raises (it runs while another error is propagating)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            self._f.close()
        try:
            if is_local(self.fs):
                os.unlink(self.tmp)
            else:
                self.fs.rm(self.tmp)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            log.warning("could not remove temporary file %s: %s", self.tmp, exc)


class OverlappedHashFile(AtomicFile):
    """An ``AtomicFile`` that overlaps its digests (sha256, xxh3-128) with writing. Locally, a helper thread reads the temp
    file back (from the page cache) in ``chunk``-sized pieces behind the writer and hashes them:
    reads and hashlib both release the GIL, and the threads meet once per chunk rather than once
    per sample (a queue hop per sample cost the writer ~15 µs in GIL hand-offs), and no sample
    stays referenced after its write. If the helper falls ``lag`` chunks behind (no free core),
    the writer hashes the next chunk itself, so a busy machine costs no more than hashing inline.
    The first chunk is hashed inline as it is written (small files never start a thread).
    ``write_parts`` hands a sample's pieces to the kernel in one ``os.writev`` (unbuffered file).
    Other filesystems hash inline, as ``AtomicFile`` does. Same bytes, digest and rename."""

    chunk = 8 << 20
    lag = 4

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, *, shard: str | None = None) -> None:
        super().__init__(fs, path, shard=shard)
        self._fd = self._f.fileno() if is_local(fs) else None
        self._cv = threading.Condition()
        self._hash_lock = threading.Lock()  # held by whoever hashes the next bytes, in order
        self._hashed = 0
        self._closing = False
        self._signalled = 0
        self._error: BaseException | None = None
        self._hasher: threading.Thread | None = None  # started once the file reaches ``chunk``
        self._buf = memoryview(bytearray())  # grown on first use, up to ``chunk``

    def _open_local(self) -> IO[bytes]:
        # readable for the read-back; unbuffered. Created by this open and never reopened:
        # reopening with O_TRUNC makes ext4 flush the whole file when it is closed.
        return open(self.tmp, "w+b", buffering=0)  # noqa: SIM115 - closed by commit/abort

    def _hash_to(self, end: int) -> None:
        """Hash the file from ``_hashed`` to ``end``; the caller holds ``_hash_lock``."""
        pos, buf, fd = self._hashed, self._buf, self._fd
        if len(buf) < min(self.chunk, end - pos):  # small shards never allocate a whole chunk
            buf = self._buf = memoryview(bytearray(min(self.chunk, end - pos)))
        while pos < end:
            n = os.preadv(fd, [buf[: min(self.chunk, end - pos)]], pos)
            if n <= 0:
                raise OSError(f"read back {n} bytes at offset {pos} of {end}")
            self._sha.update(buf[:n])
            pos += n
            self._hashed = pos

    def _hash_loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while self.size - self._hashed < self.chunk and not self._closing:
                        self._cv.wait()
                    if self._closing:
                        return  # the writer hashes what is left
                with self._hash_lock:
                    self._hash_to(self.size)
        except BaseException as exc:  # noqa: BLE001 - reported by sha256()/commit()
            self._error = exc

    def write(self, data: bytes | memoryview) -> None:
        if self._fd is None:
            super().write(data)
        else:
            self.write_parts((data,))

    def write_parts(self, parts: Sequence[bytes]) -> None:
        if self._fd is None:
            super().write_parts(parts)
            return
        parts = list(parts)
        total = sum(map(len, parts))
        try:
            _writev_all(self._fd, parts, total)
        except Exception as exc:  # noqa: BLE001 - same contract as AtomicFile.write
            raise self._failed("write failed", exc, offset=self.size) from exc
        self.size += total
        if self._hasher is None:  # the first chunk (or a small file): hash inline, the data is hot
            for part in parts:
                self._sha.update(part)
            self._hashed = self.size
            if self.size >= self.chunk:
                self._hasher = threading.Thread(
                    target=self._hash_loop, name="stallfree-shard-hash", daemon=True
                )
                self._hasher.start()
            return
        if self.size - self._hashed >= self.lag * self.chunk and self._hash_lock.acquire(blocking=False):
            try:  # the helper is not keeping up (no free core): take a chunk off it
                self._hash_to(min(self.size, self._hashed + self.chunk))
            except Exception as exc:  # noqa: BLE001
                self._hash_lock.release()
                raise self._failed("sha256 read-back failed", exc) from exc
            self._hash_lock.release()
        if self.size - self._signalled >= self.chunk:
            self._signalled = self.size
            with self._cv:
                self._cv.notify()

    def _stop_hasher(self) -> None:
        if self._hasher is not None and self._hasher.is_alive():
            with self._cv:
                self._closing = True
                self._cv.notify()
            self._hasher.join()

    def _finish_hash(self) -> None:
        if self._fd is None:
            return
        self._stop_hasher()
        try:
            if self._error is not None:
                raise self._error
            with self._hash_lock:
                self._hash_to(self.size)
        except BaseException as exc:
            self._error = None
            raise self._failed("sha256 read-back failed", exc) from exc

    def sha256(self) -> str:
        self._finish_hash()
        return super().sha256()

    def xxh3_128(self) -> str:
        self._finish_hash()
        return super().xxh3_128()

    def commit(self) -> None:
        self._finish_hash()
        super().commit()

    def abort(self) -> None:
        self._stop_hasher()
        super().abort()


_IOV_MAX = 512  # below every platform's IOV_MAX


def _writev_all(fd: int, parts: list[bytes], total: int) -> None:
    """``os.writev`` of every byte of ``parts`` (continuing after a short write)."""
    if len(parts) <= _IOV_MAX:
        written = os.writev(fd, parts)
        if written == total:
            return
    else:
        written = 0
    view = memoryview(b"".join(parts))[written:]
    while view:
        n = os.write(fd, view)
        view = view[n:]


def atomic_write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` atomically; returns its sha256 hex."""
    f = AtomicFile(fs, path)
    f.write(data)
    f.commit()
    return f.sha256()


def check_writable(fs: fsspec.AbstractFileSystem, directory: str) -> None:
    """Create ``directory`` and prove a file can be written there (then remove it), or raise WriteError."""
    probe = posixpath.join(directory, f".stallfree-probe-{uuid.uuid4().hex[:12]}")
    try:
        if is_local(fs):
            os.makedirs(directory, exist_ok=True)
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        else:
            if not is_object_store(fs):  # s3fs's makedirs creates a missing bucket: a typo would too
                with contextlib.suppress(Exception):
                    fs.makedirs(directory, exist_ok=True)
            with fs.open(probe, "wb") as f:
                f.write(b"")
            fs.rm(probe)
    except Exception as exc:  # noqa: BLE001
        raise WriteError(f"destination {directory} is not writable: {type(exc).__name__}: {exc}") from exc
