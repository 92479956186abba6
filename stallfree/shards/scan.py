"""Index tar shards that came without one: walk the tar headers (memory-mapped locally, small
ranged reads remotely) and group members into samples, exactly as DALI's ``wds2idx`` and
WebDataset do (members ``KEY.FIELD``; consecutive members with one key form a sample).

``manifest_for_tars`` builds a manifest for existing tars (``open_dataset`` on the fly;
``indexing.index_tars``, ``stallfree index``, writes it with the ``.idx`` files); ``scan_tar``
walks one tar.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import posixpath
import re
from collections.abc import Callable, Sequence
from typing import Any

import fsspec

from stallfree.shards.atomic import is_local
from stallfree.shards.errors import CorruptShardError, DuplicateKeyError, MissingShardError
from stallfree.shards.idx import IdxSample, idx_path_for
from stallfree.shards.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, ShardInfo
from stallfree.shards.tar import BLOCK, padded, parse_header, split_name

log = logging.getLogger(__name__)

_REGULAR = (b"0", b"\0", b"7")
_WINDOW = 64 * 1024


class _RangeReader:
    """``read(start, end)`` over a local mmap or remote ranged reads with a small read-ahead window,
    so runs of small members cost one request per window, and big members are skipped, not read."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, size: int) -> None:
        self.size = size
        self._fs, self._path = fs, path
        self._mm: mmap.mmap | None = None
        self._buf, self._buf_start = b"", 0
        self.requests = 0
        if is_local(fs) and size:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, start: int, end: int, ahead: bool = False) -> bytes:
        end = min(end, self.size)
        if self._mm is not None:
            return self._mm[start:end]
        b0 = self._buf_start
        if b0 <= start and end <= b0 + len(self._buf):
            return self._buf[start - b0 : end - b0]
        fetch_end = min(self.size, max(end, start + _WINDOW)) if ahead else end
        self.requests += 1
        self._buf = self._fs.cat_file(self._path, start, fetch_end)
        self._buf_start = start
        return self._buf[: end - start]

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()


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


def file_size(fs: fsspec.AbstractFileSystem, path: str, shard: str) -> int:
    """The file's size in bytes; MissingShardError naming ``shard`` if it is not there."""
    try:
        return int(fs.size(path))
    except FileNotFoundError:
        raise MissingShardError("shard not found", shard=shard) from None


def scan_tar(fs: fsspec.AbstractFileSystem, path: str, shard: str | None = None) -> list[IdxSample]:
    """Walk a tar's headers -> samples in order. Raises CorruptShardError / DuplicateKeyError naming
    the shard, the key and the byte offset of the bad header."""
    shard = shard or posixpath.basename(path)
    reader = _RangeReader(fs, path, file_size(fs, path, shard))
    try:
        return _walk(reader, shard)
    finally:
        reader.close()


def _walk(reader: _RangeReader, shard: str) -> list[IdxSample]:
    size = reader.size
    samples: list[IdxSample] = []
    seen: set[str] = set()
    cur_key: str | None = None
    cur_fields: set[str] = set()
    long_name: str | None = None
    off = 0
    largest, members = 0, 0
    while True:
        if off >= size:
            if off > size or not samples and size == 0:
                raise CorruptShardError(
                    "truncated tar: no end-of-archive blocks", shard=shard, key=cur_key, offset=off
                )
            break  # archive without the trailing zero blocks: tolerated, as tar itself does
        # read ahead (remote) once 8+ members were all small: then one window holds many headers
        block = reader.read(off, off + BLOCK, ahead=members >= 8 and largest <= 8192)
        if len(block) < BLOCK:
            raise CorruptShardError("truncated tar: header cut short", shard=shard, key=cur_key, offset=off)
        if block == bytes(BLOCK):
            break
        name, msize, typeflag = parse_header(block, off, shard, cur_key)
        data = off + BLOCK
        if data + msize > size:
            key = split_name(long_name or name)[0]
            raise CorruptShardError(
                f"truncated tar: member {long_name or name!r} needs bytes {data}..{data + msize} "
                f"but the file ends at {size}",
                shard=shard,
                key=key,
                offset=off,
            )
        nxt = data + padded(msize)
        largest = max(largest, msize)
        members += 1
        if typeflag == b"L":
            long_name = reader.read(data, data + msize).rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif typeflag == b"x":
            long_name = pax_path(reader.read(data, data + msize)) or long_name
        elif typeflag in _REGULAR:
            full = long_name or name
            long_name = None
            key, field = split_name(full)
            if key and not key.endswith("/") and field:
                if key != cur_key:
                    if key in seen:
                        raise DuplicateKeyError(
                            "sample key appears twice (members of one sample must be contiguous)",
                            shard=shard,
                            key=key,
                            offset=off,
                        )
                    seen.add(key)
                    samples.append(IdxSample(key, []))
                    cur_key, cur_fields = key, set()
                elif field in cur_fields:
                    raise DuplicateKeyError(
                        f"member {full!r} appears twice", shard=shard, key=key, offset=off
                    )
                cur_fields.add(field)
                samples[-1].members.append((field, data, msize, full))
        else:
            long_name = None  # directories, links, global headers: not sample data
        off = nxt
    return samples


def sha256_of(fs: fsspec.AbstractFileSystem, path: str, chunk: int = 8 << 20) -> str:
    """Stream a file through sha256 (whole file: used only where hashes are asked for)."""
    h = hashlib.sha256()
    if is_local(fs):
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    with fs.open(path, "rb", block_size=chunk) as f:
        while True:
            data = f.read(chunk)
            if not data:
                break
            h.update(data)
    return h.hexdigest()


# -- patterns -------------------------------------------------------------------------------

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


def resolve(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str, list[str] | None]:
    """URL -> (fs, root, shard paths or None). None means ``root`` holds (or is) a manifest."""
    if "{" in url:
        return resolve_files(expand_braces(url), **storage_options)
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    if any(c in path for c in "*?[") and not fs.exists(path):
        paths = sorted(fs.glob(path))
        if not paths:
            raise MissingShardError(f"no files match {url}", shard=url)
        return fs, _common_root(paths), paths
    if path.endswith(".json"):
        return fs, posixpath.dirname(path), None
    if path.endswith((".tar", ".arrow")):
        return fs, posixpath.dirname(path), [path]
    if fs.exists(posixpath.join(path, MANIFEST_NAME)):  # before isdir: http has no directories
        return fs, path.rstrip("/"), None
    if not fs.isdir(path):
        raise MissingShardError(f"no dataset at {url}", shard=url)
    names = sorted(p for p in fs.ls(path, detail=False) if p.endswith((".tar", ".arrow")))
    if not names:
        raise MissingShardError(f"{url} has no manifest.json and no .tar or .arrow files", shard=url)
    return fs, path.rstrip("/"), names


def resolve_files(
    urls: Sequence[str], **storage_options: Any
) -> tuple[fsspec.AbstractFileSystem, str, list[str]]:
    """Several file URLs (one filesystem: the first one's) -> (fs, their deepest common directory, paths)."""
    fs, first = fsspec.core.url_to_fs(urls[0], **storage_options)
    paths = [first] + [fsspec.core.url_to_fs(u, **storage_options)[1] for u in urls[1:]]
    return fs, _common_root(paths), paths


def _common_root(paths: list[str]) -> str:
    """The deepest directory holding all ``paths`` (shard paths in the manifest are relative to it)."""
    dirs = sorted({posixpath.dirname(p) for p in paths})
    if len(dirs) == 1:
        return dirs[0]
    return posixpath.commonprefix([d + "/" for d in dirs]).rsplit("/", 1)[0]


def relative(root: str, path: str) -> str:
    if root and path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1 :]
    return path


def manifest_for_tars(
    fs: fsspec.AbstractFileSystem,
    root: str,
    paths: list[str],
    *,
    hashes: bool = False,
    use_idx: bool = True,
    progress: Callable[[str, int], None] | None = None,
) -> tuple[Manifest, list[list[IdxSample]]]:
    """Manifest (+ each shard's samples) for existing tars; an ``.idx`` beside a tar is trusted
    when ``use_idx`` (it is checked against the tar on first use), else headers are scanned."""
    from stallfree.shards.idx import parse_idx

    shards, indices, fields = [], [], {}
    for path in paths:
        rel = relative(root, path)
        samples = None
        if use_idx:
            try:
                samples = parse_idx(fs.cat_file(idx_path_for(path)), rel)
            except FileNotFoundError:
                samples = None
        if samples is None:
            samples = scan_tar(fs, path, rel)
        size = file_size(fs, path, rel)
        for s in samples:
            for m in s.members:
                fields.setdefault(m[0], None)
        sha = sha256_of(fs, path) if hashes else None
        shards.append(ShardInfo(rel, len(samples), size, sha))
        indices.append(samples)
        if progress is not None:
            progress(rel, size)
    manifest = Manifest(FORMAT_VERSION, "tar", list(fields), shards)
    return manifest, indices
