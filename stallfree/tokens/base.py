"""What every token format gives the packer: a flat run of tokens (documents back to back, no
separators added) and the documents' lengths. ``FlatFile`` is that run for one file of tokens at a
byte offset: ``pread`` locally (never a memory map: see ``FlatFile``), ranged reads otherwise.

A source pickles as its location and its (small) document index, never as open files or
mappings: each process reopens lazily, so worker processes can use it after fork or spawn.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Protocol, runtime_checkable

import fsspec
import numpy as np

from stallfree.errors import CorruptShardError, MissingShardError, ShardError
from stallfree.storage import remote
from stallfree.storage.fs import file_size, is_local

TOKEN_FILE_MISSING = "token file not found"  # what a missing token or index file is called

INTEGER_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64", "uint64")


@runtime_checkable
class TokenSource(Protocol):
    """A flat token run: ``doc_lengths[d]`` tokens per document, ``read(start, stop)`` the tokens
    ``[start, stop)`` of all documents concatenated (no separators).

    Optional, used where present: ``read_runs(starts, counts)``, the runs ``[starts[i], starts[i]
    + counts[i])`` back to back in one new array (``TokenDataset`` reads a batch's windows with
    one call: straight into one buffer, or one concurrent remote request); ``locate(token)``,
    ``(file, byte offset or None)`` of a token for error messages."""

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
    """Tokens ``[0, count)`` of ``dtype`` stored from byte ``offset`` of one file.

    Local files are read with ``pread`` into a fresh array, not through a memory map: a file cut
    short under a mapping (re-running nanoGPT's ``prepare.py`` while a job trains on its output
    does exactly that) turns the next touch of a page past the new end into a SIGBUS that kills
    the process (rc -7, or ``WorkerDiedError ... exit code -7``); a short ``pread`` becomes a
    ``CorruptShardError`` naming the file, the byte range and the file's size now. The read is the
    copy a window needs anyway, so it costs what the mapping's page faults did (bench_tokens.py
    ``--read-path``, benchmarks/RESULTS.md "Tokens"). Remote files: ranged reads through
    ``storage/remote.py`` (lengths checked, short or failed reads retried, errors naming the URL).
    """

    def __init__(
        self,
        url: str,
        dtype: np.dtype,
        count: int,
        offset: int = 0,
        storage_options: dict[str, Any] | None = None,
        fs: fsspec.AbstractFileSystem | None = None,
        path: str | None = None,
        size: int | None = None,
    ) -> None:
        self.url, self.dtype, self.count, self.offset = url, np.dtype(dtype), int(count), int(offset)
        self.size = size  # the file's size when its source was opened (None: not known)
        self.storage_options = dict(storage_options or {})
        self._fs, self._path = fs, path
        self._file: Any = None  # the local file, unbuffered; closed when collected
        self._pid = os.getpid()

    def _resolve(self) -> tuple[fsspec.AbstractFileSystem, str]:
        if self._fs is None or self._pid != os.getpid():
            self._fs, self._path = remote.url_to_fs(self.url, **self.storage_options)
            self._pid, self._file = os.getpid(), None
        return self._fs, str(self._path)

    def _local_file(self) -> Any:
        """This process's open local file (None for remote files), its size checked once."""
        f = self._file
        if f is not None and self._pid == os.getpid():
            return f
        fs, path = self._resolve()
        if not is_local(fs):
            return None
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - lives as long as this object
        except FileNotFoundError:
            raise MissingShardError("token file not found", shard=self.url) from None
        size = os.fstat(f.fileno()).st_size
        need = self.offset + self.count * self.dtype.itemsize
        if size < need:  # shrank since the source was opened
            f.close()
            raise CorruptShardError(
                f"cut short after it was opened: tokens [0, {self.count}) are bytes {self.offset}..{need}, "
                f"the file is now {size} bytes (was it rewritten under the reader?)",
                shard=self.url,
                offset=size,
            )
        if self.size is not None and size != self.size:  # its index no longer describes it
            f.close()
            raise CorruptShardError(
                f"changed after it was opened: it was {self.size} bytes, it is now {size} "
                f"(was it rewritten under the reader?)",
                shard=self.url,
                offset=min(size, self.size),
            )
        # two threads opening at once: the last one stays here, the other's file closes when its
        # reader lets go of it (every reader holds the object it reads through, never just its fd)
        self._file = f
        return f

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as a new array: ``pread`` locally, one checked ranged read
        (``storage/remote.py``) remotely."""
        return self.read_runs(np.array([start], np.int64), np.array([stop - start], np.int64))

    def read_runs(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Tokens ``[starts[i], starts[i] + counts[i])`` for every ``i``, back to back in one new
        array: locally one ``pread`` per run straight into it; remotely one ``read_ranges`` for
        all of them (concurrent where the store allows: a batch's windows cost about one round
        trip, not one each), every range's length checked and retried there."""
        runs = list(zip(np.asarray(starts).tolist(), np.asarray(counts).tolist(), strict=True))
        total = 0
        for s, c in runs:  # plain ints: cheaper than numpy's checks on a batch's 16 windows
            if s < 0 or c < 0 or s + c > self.count:
                raise IndexError(f"token range [{s}, {s + c}) outside [0, {self.count}) of {self.url}")
            total += c
        out = np.empty(total, self.dtype)
        if not total:
            return out
        f = self._local_file()
        item, base, at = self.dtype.itemsize, self.offset, 0
        if f is not None:  # the hot loop: ~1 us of CPU a window less than going through _pread_into
            fd, buf = f.fileno(), memoryview(out).cast("B")
            for s, c in runs:
                want = c * item
                if os.preadv(fd, [buf[at : at + want]], base + s * item) != want:
                    self._pread_into(f, out[at // item : at // item + c], s, s + c)  # the rest, or why not
                at += want
            return out
        fs, path = self._resolve()
        ranges = [(base + s * item, base + (s + c) * item) for s, c in runs if c]
        flat = out.view(np.uint8)
        for (lo, hi), data in zip(ranges, remote.read_ranges(fs, path, ranges, shard=self.url), strict=True):
            flat[at : at + hi - lo] = np.frombuffer(data, np.uint8)
            at += hi - lo
        return out

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Fill ``out`` (contiguous, 1-D, of this dtype) with tokens ``[start, start + len(out))``:
        one ``pread`` straight into it locally (what a multi-file source calls per piece)."""
        c = len(out)
        if start < 0 or start + c > self.count:
            raise IndexError(f"token range [{start}, {start + c}) outside [0, {self.count}) of {self.url}")
        if not c:
            return
        f = self._local_file()
        if f is None:
            out[:] = self.read(start, start + c)
        elif (
            os.preadv(f.fileno(), [out], self.offset + start * self.dtype.itemsize) != c * self.dtype.itemsize
        ):
            self._pread_into(f, out, start, start + c)  # the rest, or why not

    def handle(self) -> Any:
        """This process's open local file (opened, and its size checked, on first use), for a
        source that issues its own preads. Hold the object, not its descriptor, while reading:
        a racing thread's first open may replace it here, and it closes when the last user lets
        go. Remote files have none (ValueError)."""
        f = self._local_file()
        if f is None:
            raise ValueError(f"{self.url} is not a local file")
        return f

    def locate(self, token: int) -> tuple[str, int]:
        """(file, byte offset) of token ``token``, for error messages."""
        return self.url, self.offset + token * self.dtype.itemsize

    def _pread_into(self, f: Any, out: np.ndarray, start: int, stop: int) -> None:
        """Fill ``out`` with tokens ``[start, stop)``; a short read is the file cut short."""
        buf = memoryview(out).cast("B")
        lo = self.offset + start * self.dtype.itemsize
        fd, got, want = f.fileno(), 0, len(buf)
        try:
            while got < want:  # Linux caps one read at ~2 GiB: a big scan takes a few
                n = os.preadv(fd, [buf[got:]], lo + got)
                if n == 0:
                    break
                got += n
        except OSError as exc:
            raise CorruptShardError(f"read failed: {exc}", shard=self.url, offset=lo + got) from exc
        if got < want:
            now = os.fstat(fd).st_size
            raise CorruptShardError(
                f"cut short after it was opened: tokens [{start}, {stop}) are bytes {lo}..{lo + want}, "
                f"the file is now {now} bytes (was it rewritten under the reader?)",
                shard=self.url,
                offset=min(lo + got, now),  # where the bytes end
            )

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("url", "dtype", "count", "offset", "storage_options", "size")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


def read_whole(fs: fsspec.AbstractFileSystem, path: str, url: str) -> bytes:
    """A whole small file (a Megatron ``.idx``, a remote Arrow file): remotely a length-checked,
    retried ``read_file`` of the size the store reports; MissingShardError naming ``url``."""
    if is_local(fs):
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise MissingShardError(TOKEN_FILE_MISSING, shard=url) from None
    return remote.read_file(
        fs, path, shard=url, size=file_size(fs, path, shard=url, missing=TOKEN_FILE_MISSING)
    )


def check_lengths(lengths: np.ndarray, name: str) -> None:
    if len(lengths) and int(lengths.min()) < 0:
        d = int(np.argmin(lengths))
        raise ShardError(f"document {d} has a negative length {int(lengths[d])}", shard=name)
