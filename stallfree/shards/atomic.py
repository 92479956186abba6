"""Write a file under a temporary name and rename it into place, so a crash or an exception never
leaves a half-written file under its final name. Hashes (sha256) and counts bytes as they go.

Local paths use plain ``open``/``os.replace`` (atomic on POSIX); other fsspec filesystems write the
temp object and ``mv`` it (object stores: the final object appears whole or not at all).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import posixpath
import queue
import threading
import uuid
from collections.abc import Sequence
from typing import IO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from stallfree.shards.errors import WriteError

log = logging.getLogger(__name__)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def temp_name(path: str) -> str:
    """A hidden sibling of ``path``: same directory (same filesystem, so rename is cheap)."""
    head, tail = posixpath.split(path)
    return posixpath.join(head, f".{tail}.tmp-{uuid.uuid4().hex[:12]}")


class AtomicFile:
    """A binary file being written under a temp name: ``write``, then ``commit`` or ``abort``."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, *, shard: str | None = None) -> None:
        self.fs = fs
        self.path = path
        self.tmp = temp_name(path)
        self.size = 0
        self._sha = hashlib.sha256()
        self._shard = shard or posixpath.basename(path)
        self._done = False
        try:
            parent = posixpath.dirname(path)
            if is_local(fs):
                if parent:
                    os.makedirs(parent, exist_ok=True)
                self._f: IO[bytes] = self._open_local()
            else:
                if parent:
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
            self.abort()
            raise WriteError(
                f"write failed: {type(exc).__name__}: {exc}", shard=self._shard, offset=self.size
            ) from exc
        self._sha.update(data)
        self.size += len(data)

    def sha256(self) -> str:
        return self._sha.hexdigest()

    def commit(self) -> None:
        """Close and rename into place; on failure the temp file is removed and WriteError raised."""
        if self._done:
            return
        try:
            self._f.close()
            if is_local(self.fs):
                os.replace(self.tmp, self.path)
            else:
                self.fs.mv(self.tmp, self.path)
        except Exception as exc:  # noqa: BLE001
            self.abort()
            raise WriteError(
                f"cannot finish {self.path}: {type(exc).__name__}: {exc}", shard=self._shard
            ) from exc
        self._done = True

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
    """An ``AtomicFile`` whose sha256 runs on a helper thread: hashlib releases the GIL on large
    buffers, so hashing one sample overlaps writing the next (writing a shard is otherwise write
    + hash one after the other). Locally the file is unbuffered and ``write_parts`` hands a
    sample's pieces to the kernel in one ``os.writev``: no copy into a user-space buffer, one
    system call per sample. Same bytes, same digest, same temp-then-rename as ``AtomicFile``."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, *, shard: str | None = None) -> None:
        super().__init__(fs, path, shard=shard)
        self._fd = self._f.fileno() if is_local(fs) else None
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._hasher = threading.Thread(target=self._hash_loop, name="stallfree-shard-hash", daemon=True)
        self._hasher.start()

    def _open_local(self) -> IO[bytes]:
        # unbuffered: writes go straight to the kernel (created here, never reopened: reopening
        # with O_TRUNC would make ext4 flush the whole file when it is closed)
        return open(self.tmp, "wb", buffering=0)  # noqa: SIM115 - closed by commit/abort

    def _hash_loop(self) -> None:
        update = self._sha.update
        small: list[bytes] = []
        while (parts := self._pending.get()) is not None:
            for part in parts:  # headers and padding joined: one update instead of several
                if len(part) < 4096:
                    small.append(part)
                    continue
                if small:
                    update(b"".join(small))
                    small.clear()
                update(part)
        if small:
            update(b"".join(small))

    def write(self, data: bytes | memoryview) -> None:
        self.write_parts((data,))

    def write_parts(self, parts: Sequence[bytes]) -> None:
        # the hasher reads the pieces later: only immutable bytes may be handed over
        parts = [p if type(p) is bytes else bytes(p) for p in parts]
        total = sum(map(len, parts))
        try:
            if self._fd is None:
                for part in parts:
                    self._f.write(part)
            else:
                _writev_all(self._fd, parts, total)
        except Exception as exc:  # noqa: BLE001 - same contract as AtomicFile.write
            self.abort()
            raise WriteError(
                f"write failed: {type(exc).__name__}: {exc}", shard=self._shard, offset=self.size
            ) from exc
        self.size += total
        self._pending.put(parts)

    def _finish_hash(self) -> None:
        if self._hasher.is_alive():
            self._pending.put(None)
            self._hasher.join()

    def sha256(self) -> str:
        self._finish_hash()
        return super().sha256()

    def commit(self) -> None:
        self._finish_hash()
        super().commit()

    def abort(self) -> None:
        self._finish_hash()
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
            with contextlib.suppress(Exception):
                fs.makedirs(directory, exist_ok=True)
            with fs.open(probe, "wb") as f:
                f.write(b"")
            fs.rm(probe)
    except Exception as exc:  # noqa: BLE001
        raise WriteError(f"destination {directory} is not writable: {type(exc).__name__}: {exc}") from exc
