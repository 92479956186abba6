"""What kind of filesystem a path is on, and a URL resolved once (``Location``).

Why here: ``is_local`` used to live in the atomic-write module and was imported from it by a dozen
files that write nothing; brace patterns lived with the tar scanner; and three ``file_size``
functions (shards, tokens, remote) answered "how big is this file" with three wordings. They are
the facts every reader asks about a file before reading it, so they sit on the ground floor beside
``remote.py`` (whose retried lookups ``file_size`` and ``open_read`` use).

``Location`` is Megatron-Energon's ``EPath`` idea: the user's URL, the filesystem fsspec made
for it and the path on it, carried together. ``open_dataset`` makes one at its entrance and hands
it down, so one open asks fsspec (``remote.url_to_fs``) once, not once per step that needs the
filesystem. Pickled, it keeps the URL and options and makes its filesystem again on first use in
the new process (remote clients do not survive fork or pickling).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from stallfree.errors import MissingShardError, ShardReadError
from stallfree.storage import remote


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """The local disk (plain ``open``, ``os.replace``, memory maps work on its paths)."""
    return isinstance(fs, LocalFileSystem)


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    """S3, GCS, Azure blob and the like (their fsspec classes split paths into bucket + key): no
    directories, no rename; a copy is atomic on the server."""
    return not is_local(fs) and callable(getattr(fs, "split_path", None))


_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """``data-{000..002}.tar`` -> 3 names (zero padding kept); ``{a,b}`` lists; nested left to right."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        step = 1 if int(hi) >= int(lo) else -1
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
    else:
        items = body.split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [out for item in items for out in expand_braces(head + item + tail)]


def file_size(
    fs: fsspec.AbstractFileSystem,
    path: str,
    *,
    shard: str,
    missing: str | None = None,
    policy: remote.RetryPolicy | None = None,
) -> int:
    """The file's size in bytes. ``MissingShardError`` naming ``shard`` if it is not there (its
    reason ``missing``, or "URL not found"); remotely, a store that could not be asked is a
    ``RemoteReadError`` after retries (fsspec's HTTP ``size`` calls a dead server's file "not
    found"), and one that will not tell the size a ``ShardReadError``."""
    if is_local(fs):
        try:
            return int(fs.size(path))
        except FileNotFoundError:
            raise MissingShardError(missing or f"{path} not found", shard=shard) from None
    info = remote.lookup(fs, path, shard=shard, policy=policy)
    if info is None:
        raise MissingShardError(missing or f"{remote.describe(fs, path)} not found", shard=shard)
    size = info.get("size")
    if size is None:
        raise ShardReadError(
            f"{remote.describe(fs, path)} does not report its size (an HTTP server must send Content-Length)",
            shard=shard,
        )
    return int(size)


def open_read(
    fs: fsspec.AbstractFileSystem,
    path: str,
    size: int,
    *,
    shard: str,
    block_size: int = 0,
    policy: remote.RetryPolicy | None = None,
) -> Any:
    """A read-only file object for ``path`` of ``size`` bytes: the filesystem's own for local
    files, a ``remote.RangeFile`` (checked, retried reads) for remote ones. For sequential passes
    (``verify``) and table readers that want a file."""
    if is_local(fs):
        return fs.open(path, mode="rb")
    return remote.RangeFile(fs, path, size, shard=shard, block_size=block_size, policy=policy)


@dataclass(frozen=True, eq=False)
class Location:
    """A URL resolved once: ``url`` as the user gave it, ``path`` on ``fs`` (fsspec's stripped
    form; a brace pattern keeps its braces, ``expand`` lists them), and the ``storage_options`` it
    was made with. Hand it down instead of the URL so nothing below resolves the URL again.
    ``child(path)`` is another path on the same filesystem (no new lookup).

    Picklable: the filesystem is left out and made again from ``fs_url`` (the path with its
    protocol) on first use in the unpickling process."""

    url: str
    path: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    _fs: Any = field(default=None, repr=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(cls, url: str, **storage_options: Any) -> Location:
        """Resolve ``url`` with ``storage_options``: the one ``remote.url_to_fs`` call."""
        fs, path = remote.url_to_fs(url, **storage_options)
        return cls(url, path, dict(storage_options), fs)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        fs = self._fs
        if fs is None:
            with self._lock:
                fs = self._fs
                if fs is None:
                    fs = remote.url_to_fs(self.fs_url, **self.storage_options)[0]
                    object.__setattr__(self, "_fs", fs)
        return fs

    @property
    def fs_url(self) -> str:
        """The path with its protocol (``s3://b/k``, ``/d`` locally): a URL that makes this
        filesystem again."""
        if self._fs is None:
            return self.url
        return self._fs.unstrip_protocol(self.path or "/")

    @property
    def local(self) -> bool:
        return is_local(self.fs)

    def child(self, path: str) -> Location:
        """``path`` (a path on this filesystem, not a URL) as a Location sharing this filesystem."""
        return Location(self.fs.unstrip_protocol(path), path, self.storage_options, self.fs)

    def expand(self) -> list[str]:
        """The paths a brace pattern names (``d-{000..002}.tar`` -> 3), or ``[path]``."""
        return expand_braces(self.path)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild, (self.fs_url, self.path, dict(self.storage_options)))


def _rebuild(url: str, path: str, storage_options: dict[str, Any]) -> Location:
    return Location(url, path, storage_options)


__all__ = ["Location", "expand_braces", "file_size", "is_local", "is_object_store", "open_read"]
