"""Tar shards in WebDataset's convention: plain POSIX (ustar) tar, members ``KEY.FIELD``, one
sample's members contiguous. Headers are deterministic (fixed mtime, uid, gid, mode, no owner
names), so the same samples always give the same bytes, and so the same sha256.

Beside each shard goes DALI's text index (see ``idx.py``) so ``fn.readers.webdataset`` and our own
reader can seek straight to a member's data, and a CRC32 per member (``sums.py``), computed as the
member is written, so a damaged sample can be named.
"""

from __future__ import annotations

import json
import posixpath
from array import array
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from stallfree.errors import CorruptShardError, DuplicateKeyError, WriteError
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.naming import check_field, check_key
from stallfree.shards.tar.idx import IdxSample, idx_path_for, render_idx
from stallfree.shards.tar.sums import checksum, render_sums, sums_path_for
from stallfree.storage.atomic import AtomicFile, CommitOnExit

BLOCK = 512
MTIME = 0
MODE = 0o644
_MAX_SIZE = 8**11 - 1  # 11 octal digits: just under 8 GiB per member
_TRAILER = bytes(2 * BLOCK)
_ZERO = bytes(BLOCK)

# The constant part of every header, checksum field blank; name, size and checksum are filled in.
_TEMPLATE = bytearray(BLOCK)
_TEMPLATE[100:108] = b"%07o\0" % MODE
_TEMPLATE[108:116] = b"0000000\0"
_TEMPLATE[116:124] = b"0000000\0"
_TEMPLATE[136:148] = b"%011o\0" % MTIME
_TEMPLATE[148:156] = b"        "
_TEMPLATE[156:157] = b"0"
_TEMPLATE[257:263] = b"ustar\0"
_TEMPLATE[263:265] = b"00"
_TEMPLATE[329:337] = b"0000000\0"
_TEMPLATE[337:345] = b"0000000\0"
_TEMPLATE_SUM = sum(_TEMPLATE)


def padded(size: int) -> int:
    """Bytes a member's data takes in the archive (rounded up to whole blocks)."""
    return (size + BLOCK - 1) // BLOCK * BLOCK


def member_header(name: str, size: int) -> bytes:
    """A ustar header for a regular file; names over 100 bytes use the 155-byte prefix field."""
    raw = name.encode("utf-8")
    prefix = b""
    if len(raw) > 100:
        cut = raw.rfind(b"/", 0, 156)
        if cut <= 0 or len(raw) - cut - 1 > 100:
            raise WriteError(f"member name too long for a ustar header ({len(raw)} bytes): {name!r}")
        prefix, raw = raw[:cut], raw[cut + 1 :]
    if size > _MAX_SIZE:
        raise WriteError(f"member {name!r} is {size} bytes; tar members are limited to 8 GiB here")
    h = bytearray(_TEMPLATE)
    h[0 : len(raw)] = raw
    h[124:136] = b"%011o\0" % size
    if prefix:
        h[345 : 345 + len(prefix)] = prefix
    h[148:156] = b"%06o\0 " % (sum(h) if prefix else _TEMPLATE_SUM + sum(raw) + sum(h[124:136]))
    return bytes(h)


def encode_value(value: Any, field: str, key: str) -> bytes:
    """Field value -> member bytes, in WebDataset's conventions (``cls`` 3 -> b"3", arrays -> .npy)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bool):
        return b"1" if value else b"0"
    if isinstance(value, (int, np.integer)):
        return str(int(value)).encode()
    if isinstance(value, (float, np.floating)):
        return repr(float(value)).encode()
    if isinstance(value, np.ndarray):
        import io

        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True).encode()
    raise WriteError(f"field {field!r}: cannot store a {type(value).__name__} in a tar shard", key=key)


@dataclass
class PreparedSample:
    """A sample encoded for a tar shard: member names and data; ``nbytes`` is its archive footprint."""

    key: str
    members: list[tuple[str, str, bytes]]  # (field, member name, data)
    nbytes: int


def prepare(sample: dict[str, Any]) -> PreparedSample:
    """Validate and encode a sample (fields sorted, so member order never depends on dict order)."""
    if not isinstance(sample, dict):
        raise WriteError(f"a sample must be a dict, got {type(sample).__name__}")
    key = check_key(sample.get("__key__"))
    members = []
    nbytes = 0
    for field in sorted(sample):
        if field.startswith("_"):
            continue
        check_field(field, key)
        data = encode_value(sample[field], field, key)
        members.append((field, f"{key}.{field}", data))
        nbytes += BLOCK + padded(len(data))
    if not members:
        raise WriteError("sample has no fields besides '__key__'", key=key)
    return PreparedSample(key, members, nbytes)


class TarShardWriter(CommitOnExit):
    """Writes one tar shard (and its ``.idx`` and ``.sums``) under temp names, renamed into place
    on ``close``.

    >>> with TarShardWriter("/data/shard-000000.tar") as w:
    ...     w.write({"__key__": "a", "jpg": b"...", "cls": 3})
    """

    suffix = ".tar"
    # how the shard file is written (``format_tar`` has one with ``OverlappedHashFile``: sha256 on a thread)
    file_class: type[AtomicFile] = AtomicFile
    field_types = None  # every field is bytes: nothing for the manifest's ``field_types``
    schema = None  # (no column types to carry over to the next shard)

    def __init__(
        self, path: str, fs: fsspec.AbstractFileSystem | None = None, **storage_options: Any
    ) -> None:
        if fs is None:
            fs, path = fsspec.core.url_to_fs(path, **storage_options)
        self.fs = fs
        self.path = path
        self.idx_path = idx_path_for(path)
        self.sums_path = sums_path_for(path)
        self.name = posixpath.basename(path)
        self._file = self.file_class(fs, path, shard=self.name)
        self._keys: set[str] = set()
        self._index: list[IdxSample] = []
        self._sums = array("I")  # one CRC32 per member, in the index's order
        self._fields: dict[str, None] = {}
        self.info: ShardInfo | None = None

    @property
    def samples(self) -> int:
        return len(self._index)

    @property
    def bytes(self) -> int:
        """Bytes written so far, not counting the end-of-archive blocks ``close`` adds."""
        return self._file.size

    @property
    def fields(self) -> list[str]:
        return list(self._fields)

    def write(self, sample: dict[str, Any]) -> int:
        """Append one sample; returns the bytes it took."""
        return self.write_prepared(prepare(sample))

    def write_prepared(self, prepared: PreparedSample) -> int:
        if self.info is not None:
            raise WriteError("shard already closed", shard=self.name)
        key = prepared.key
        if key in self._keys:
            raise DuplicateKeyError(
                "duplicate sample key in shard", shard=self.name, key=key, offset=self.bytes
            )
        self._keys.add(key)
        start = pos = self.bytes
        entries = []
        parts: list[bytes] = []
        for field, name, data in prepared.members:
            size = len(data)
            parts.append(member_header(name, size))
            entries.append((field, pos + BLOCK, size, name))
            self._sums.append(checksum(data))
            parts.append(data)
            pad = padded(size) - size
            if pad:
                parts.append(_ZERO[:pad])
            pos += BLOCK + size + pad
            self._fields.setdefault(field, None)
        self._file.write_parts(parts)  # the whole sample at once (one system call locally)
        self._index.append(IdxSample(key, entries))
        return self.bytes - start

    def close(self) -> ShardInfo:
        """Finish the archive, write the ``.idx``, rename both into place; returns the shard's info."""
        if self.info is not None:
            return self.info
        self._file.write(_TRAILER)
        # the digest first: an overlapped hash finishes (or reports its failure) before any rename
        digest, fast = self._file.sha256(), self._file.xxh3_128()
        idx = AtomicFile(self.fs, self.idx_path, shard=self.name)
        sums = AtomicFile(self.fs, self.sums_path, shard=self.name)
        try:
            idx.write(render_idx(self._index).encode())
            sums.write(render_sums(self._sums))
            idx.commit()
            sums.commit()
        except BaseException:
            idx.abort()
            sums.abort()
            self._file.abort()
            raise
        try:
            self._file.commit()  # the tar last: a final-named shard always has its index and sums
        except BaseException:
            try:
                self.fs.rm_file(self.sums_path)  # (the caller removes the .idx, as it always did)
            except Exception:  # noqa: BLE001 - the commit's error is the one to report
                pass
            raise
        self.info = ShardInfo(self.name, len(self._index), self._file.size, digest, xxh3_128=fast)
        return self.info

    def abort(self) -> None:
        """Drop everything written; nothing appears under the final names."""
        self._file.abort()


def parse_header(
    block: bytes | memoryview, offset: int, shard: str, key: str | None = None
) -> tuple[str, int, bytes]:
    """Parse one 512-byte header -> (name, size, typeflag); checks the checksum.

    Raises CorruptShardError naming the shard, the last good key and the header's byte offset.
    """
    if len(block) < BLOCK:
        raise CorruptShardError("truncated tar: header cut short", shard=shard, key=key, offset=offset)
    block = bytes(block[:BLOCK])
    try:
        stored = int(block[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise CorruptShardError(
            "corrupt tar header: bad checksum field", shard=shard, key=key, offset=offset
        ) from None
    actual = sum(block[:148]) + 256 + sum(block[156:])
    if stored != actual:
        raise CorruptShardError(
            f"corrupt tar header: checksum {stored} != computed {actual}", shard=shard, key=key, offset=offset
        )
    name = block[0:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar" and block[345] != 0:
        name = block[345:500].split(b"\0", 1)[0] + b"/" + name
    raw_size = block[124:136]
    try:
        if raw_size[0] & 0x80:  # GNU base-256 for huge members
            size = int.from_bytes(raw_size[1:], "big")
        else:
            size = int(raw_size.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise CorruptShardError(
            "corrupt tar header: bad size field", shard=shard, key=key, offset=offset
        ) from None
    return name.decode("utf-8", "surrogateescape"), size, block[156:157]


def split_name(name: str) -> tuple[str, str]:
    """``dir/key.field.ext`` -> (``dir/key``, ``field.ext``): the first dot after the last slash."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]
