"""The one tar walker: every reader of tar headers (``scan_tar`` for ``open_dataset`` and
``stallfree index``, the loader's fallback when a shard has no ``.idx``, ``stallfree verify``, the
re-shard source) walks an archive through ``walk_tar`` and groups members into samples through
``group_samples``, so a truncated or corrupt archive is detected, and named, the same way
everywhere. Plain generators over a ``ByteReader``; no torch, no fsspec beyond ``RangeReader``
(whose remote reads are ``remote.read_range``'s).

Handles ustar (with its 155-byte prefix), GNU long names (``L``) and pax ``path`` records (``x``).
Strict about the end: an archive must end in a zero block. One that stops after a complete
member is treated as truncated, because a copy cut exactly between two members is
indistinguishable from a complete archive otherwise, and every sample past the cut would be lost
without a word.
"""

from __future__ import annotations

import mmap
import posixpath
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import fsspec

from stallfree.errors import CorruptShardError, DuplicateKeyError
from stallfree.shards.tar.idx import IdxSample
from stallfree.shards.tar.writer import BLOCK, padded, parse_header, split_name
from stallfree.storage.fs import is_local
from stallfree.storage.remote import read_range

REGULAR = (b"0", b"\0", b"7")  # typeflags of regular files (7: contiguous file, read as regular)
_ZERO = bytes(BLOCK)
_WINDOW = 64 * 1024


class ByteReader(Protocol):
    """What the walker reads through: the file's ``size`` and ``read(start, end)``. ``ahead`` is a
    hint that more small reads follow (a remote reader may fetch a larger window)."""

    size: int

    def read(self, start: int, end: int, ahead: bool = False) -> bytes: ...


class RangeReader:
    """``read(start, end)`` over a local mmap or remote ranged reads with a small read-ahead window,
    so runs of small members cost one request per window, and big members are skipped, not read.
    Remote reads go through ``remote.read_range`` (length checked, retried); ``shard`` names
    them in errors (default: the file's name)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, size: int, shard: str | None = None) -> None:
        self.size = size
        self._fs, self._path = fs, path
        self._shard = shard or posixpath.basename(path)
        self._mm: mmap.mmap | None = None
        self._buf, self._buf_start = b"", 0
        self.requests = 0
        if is_local(fs) and size:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, start: int, end: int, ahead: bool = False) -> bytes:
        end = min(end, self.size)
        if end <= start:
            return b""
        if self._mm is not None:
            return self._mm[start:end]
        b0 = self._buf_start
        if b0 <= start and end <= b0 + len(self._buf):
            return self._buf[start - b0 : end - b0]
        fetch_end = min(self.size, max(end, start + _WINDOW)) if ahead else end
        self.requests += 1
        self._buf = read_range(self._fs, self._path, start, fetch_end, shard=self._shard)
        self._buf_start = start
        return self._buf[: end - start]

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


@dataclass(frozen=True, slots=True)
class TarMember:
    """A regular file in the archive: its full name (long-name and pax records applied), where its
    data starts and how long it is. Its own header is the block before ``offset``."""

    name: str
    offset: int
    size: int

    @property
    def header(self) -> int:
        return self.offset - BLOCK

    @property
    def end(self) -> int:
        return self.offset + self.size


def pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header, if any (records are ``LEN key=value\\n``; a
    later record overrides an earlier one, as in POSIX)."""
    pos = 0
    path = None
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(data[pos:space])
        except ValueError:
            break
        if length <= 0:
            break
        record = data[space + 1 : pos + length - 1]
        k, _, v = record.partition(b"=")
        if k == b"path":
            path = v.decode("utf-8", "surrogateescape")
        pos += length
    return path


def walk_tar(reader: ByteReader, shard: str) -> Iterator[TarMember]:
    """Regular members in archive order; member data is not read (the caller reads what it needs
    through the same reader before asking for the next member, so a sequential reader works).

    Raises CorruptShardError at the first spot that cannot be trusted, naming the shard, the key
    of the last member before it (or of the member cut short) and the byte offset of its header:
    a bad checksum or size field, a header cut short, a member whose data runs past the end of the
    file, an empty file, or an archive without its end-of-archive block."""
    size = reader.size
    off = 0
    last_key: str | None = None
    long_name: str | None = None
    largest, members = 0, 0
    while True:
        if off >= size:
            raise CorruptShardError(
                "truncated tar: no end-of-archive blocks" + ("" if size else " (empty file)"),
                shard=shard,
                key=last_key,
                offset=off,
            )
        # read ahead (remote) once 8+ members were all small: then one window holds many headers
        block = reader.read(off, off + BLOCK, ahead=members >= 8 and largest <= 8192)
        if len(block) < BLOCK:
            raise CorruptShardError("truncated tar: header cut short", shard=shard, key=last_key, offset=off)
        if block == _ZERO:
            return
        name, msize, typeflag = parse_header(block, off, shard, last_key)
        data = off + BLOCK
        full = (long_name or name) if typeflag in REGULAR else name
        if data + msize > size:
            raise CorruptShardError(
                f"truncated tar: member {full!r} needs {msize} bytes, only {max(0, size - data)} present",
                shard=shard,
                key=split_name(full)[0] if typeflag in REGULAR else last_key,
                offset=off,
            )
        largest = max(largest, msize)
        members += 1
        if typeflag == b"L":
            long_name = reader.read(data, data + msize).rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif typeflag == b"x":
            long_name = pax_path(reader.read(data, data + msize)) or long_name
        elif typeflag in REGULAR:
            long_name = None
            last_key = split_name(full)[0]
            yield TarMember(full, data, msize)
        elif typeflag != b"g":  # a global header leaves a pending long name alone
            long_name = None  # directories, links: not sample data
        off = data + padded(msize)


def sample_parts(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member that is sample data (``KEY.FIELD``, WebDataset's rule), or None
    for anything else (no dot, a hidden file, a name ending in ``/``)."""
    key, field = split_name(name)
    if not key or key.endswith("/") or not field:
        return None
    return key, field


def group_samples(
    members: Iterable[TarMember],
    shard: str,
    on_duplicate: Callable[[DuplicateKeyError], None] | None = None,
) -> Iterator[IdxSample]:
    """Consecutive members with one key form a sample (WebDataset's rule); members that are not
    sample data are left out. A sample is yielded once the next one starts (or the archive ends),
    so one that a corrupt spot may have cut short is never yielded; the walker's error follows.

    A key seen again after other samples, or a member repeated inside a sample, is a
    DuplicateKeyError naming the shard, key and header offset: raised, or, with ``on_duplicate``,
    handed to it just before the sample it concerns is yielded (a repeated member is dropped; a
    repeated key still yields its sample, so the caller decides)."""
    seen: set[str] = set()
    cur: IdxSample | None = None
    fields: set[str] = set()
    it = iter(members)
    while True:
        try:
            m = next(it)
        except StopIteration:
            break
        except CorruptShardError as exc:
            # the bad spot belongs to another sample (a member cut short names its own key): the
            # one in progress is whole. Otherwise whether it continued past the spot is unknown.
            if cur is not None and exc.key != cur.key:
                yield cur
            raise
        parts = sample_parts(m.name)
        if parts is None:
            continue
        key, field = parts
        if cur is not None and key == cur.key:
            if field in fields:
                err = DuplicateKeyError(
                    f"member {m.name!r} appears twice", shard=shard, key=key, offset=m.header
                )
                if on_duplicate is None:
                    raise err
                on_duplicate(err)
                continue
        else:
            if cur is not None:
                yield cur
            if key in seen:
                err = DuplicateKeyError(
                    "sample key appears twice (members of one sample must be contiguous)",
                    shard=shard,
                    key=key,
                    offset=m.header,
                )
                if on_duplicate is None:
                    raise err
                on_duplicate(err)
            seen.add(key)
            cur, fields = IdxSample(key, []), set()
        fields.add(field)
        cur.members.append((field, m.offset, m.size, m.name))
    if cur is not None:
        yield cur
