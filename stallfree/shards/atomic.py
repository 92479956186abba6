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
import uuid
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
                self._f: IO[bytes] = open(self.tmp, "wb", buffering=1 << 20)  # noqa: SIM115
            else:
                if parent:
                    with contextlib.suppress(Exception):
                        fs.makedirs(parent, exist_ok=True)
                self._f = fs.open(self.tmp, "wb")
        except Exception as exc:  # noqa: BLE001 - any backend error means "cannot write here"
            raise WriteError(f"cannot write {path}: {type(exc).__name__}: {exc}", shard=self._shard) from exc

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
