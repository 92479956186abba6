"""What every token format gives the packer: a flat run of tokens (documents back to back, no
separators added) and the documents' lengths. ``FlatFile`` is that run for one file of tokens at a
byte offset: memory-mapped locally, ranged reads through fsspec otherwise.

A source pickles as its location and its (small) document index, never as open files or
mappings: each process reopens lazily, so worker processes can use it after fork or spawn.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import Any, Protocol, runtime_checkable

import fsspec
import numpy as np

from stallfree.shards.atomic import is_local
from stallfree.shards.errors import CorruptShardError, MissingShardError, ShardError

INTEGER_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "uint64")


@runtime_checkable
class TokenSource(Protocol):
    """A flat token run: ``doc_lengths[d]`` tokens per document, ``read(start, stop)`` the tokens
    ``[start, stop)`` of all documents concatenated (no separators)."""

    name: str
    dtype: np.dtype
    doc_lengths: np.ndarray  # int64, one entry per document

    def read(self, start: int, stop: int) -> np.ndarray: ...

    @property
    def fingerprint(self) -> str: ...


def token_dtype(dtype: Any, what: str) -> np.dtype:
    """An integer numpy dtype from ``dtype`` (name, numpy or Python type); ValueError naming ``what``."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"{what}: {dtype!r} is not a dtype") from None
    if dt.name not in INTEGER_DTYPES:
        raise ValueError(
            f"{what}: token dtype must be an integer type ({', '.join(INTEGER_DTYPES)}), got {dt}"
        )
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt


def fingerprint_of(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


class FlatFile:
    """Tokens ``[0, count)`` of ``dtype`` stored from byte ``offset`` of one file."""

    def __init__(
        self,
        url: str,
        dtype: np.dtype,
        count: int,
        offset: int = 0,
        storage_options: dict[str, Any] | None = None,
        fs: fsspec.AbstractFileSystem | None = None,
        path: str | None = None,
    ) -> None:
        self.url, self.dtype, self.count, self.offset = url, np.dtype(dtype), int(count), int(offset)
        self.storage_options = dict(storage_options or {})
        self._fs, self._path = fs, path
        self._array: np.ndarray | None = None
        self._pid = os.getpid()

    def _resolve(self) -> tuple[fsspec.AbstractFileSystem, str]:
        if self._fs is None or self._pid != os.getpid():
            self._fs, self._path = fsspec.core.url_to_fs(self.url, **self.storage_options)
            self._pid, self._array = os.getpid(), None
        return self._fs, str(self._path)

    def _local_array(self) -> np.ndarray | None:
        """The whole run as a read-only array over a memory map (None for remote files)."""
        if self._array is not None and self._pid == os.getpid():
            return self._array
        fs, path = self._resolve()
        if not is_local(fs):
            return None
        if self.count == 0:
            self._array = np.zeros(0, self.dtype)
            return self._array
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise MissingShardError("token file not found", shard=self.url) from None
        need = self.offset + self.count * self.dtype.itemsize
        if len(mm) < need:  # shrank since it was opened
            raise CorruptShardError(
                f"truncated: needs {need} bytes, the file has {len(mm)}", shard=self.url, offset=len(mm)
            )
        self._array = np.frombuffer(mm, self.dtype, self.count, self.offset)
        return self._array

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)``: a view of the mapping locally, one ranged read remotely."""
        if not 0 <= start <= stop <= self.count:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.count}) of {self.url}")
        arr = self._local_array()
        if arr is not None:
            return arr[start:stop]
        fs, path = self._resolve()
        size = self.dtype.itemsize
        lo, hi = self.offset + start * size, self.offset + stop * size
        try:
            data = fs.cat_file(path, lo, hi)
        except FileNotFoundError:
            raise MissingShardError("token file not found", shard=self.url) from None
        except OSError as exc:
            raise CorruptShardError(f"ranged read failed: {exc}", shard=self.url, offset=lo) from exc
        if len(data) != hi - lo:
            raise CorruptShardError(
                f"short read: asked for bytes {lo}..{hi}, got {len(data)}",
                shard=self.url,
                offset=lo + len(data),
            )
        return np.frombuffer(data, self.dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("url", "dtype", "count", "offset", "storage_options")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


def file_size(fs: fsspec.AbstractFileSystem, path: str, url: str) -> int:
    try:
        return int(fs.size(path))
    except FileNotFoundError:
        raise MissingShardError("token file not found", shard=url) from None


def check_lengths(lengths: np.ndarray, name: str) -> None:
    if len(lengths) and int(lengths.min()) < 0:
        d = int(np.argmin(lengths))
        raise ShardError(f"document {d} has a negative length {int(lengths[d])}", shard=name)
