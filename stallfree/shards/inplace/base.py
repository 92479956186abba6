"""Datasets of offset-table files read in place: MosaicML MDS and LitData directories opened by
``open_dataset`` with no ``stallfree shard`` first (formats ``format_mds.MDS`` and
``format_litdata.LITDATA``; their index and sample layouts are parsed by the same functions the
sharding sources use: ``source_mds``, ``source_litdata``, ``source_offsets``).

A dataset is its ``index.json`` plus the files it lists. ``open_dataset`` describes it as a
manifest (``scan_index``): one shard per file, stamped with the store's version of the file and
the hash of what ``index.json`` says of it (``stamps.py``), so the dataset's fingerprint follows
both. A shard's reader (``OffsetShardReader``) reads ``index.json`` itself, as a tar reader reads
its ``.idx`` (``Format.sidecars`` names it, so staging copies it beside the shard), parsed once
per process, and refuses to read a shard whose entry changed since the dataset was opened.

Samples are what ``stallfree shard`` of the same directory, then ``open_dataset`` of its (tar)
output, gives: ``__key__`` as the source names it (a ``__key__``/``key`` column, else the global
sample number, zero-padded), every other field as the bytes the tar shard holds
(``tar.encode_value``: bytes and text as they are, numbers as text, arrays as ``.npy``).

Raw files are read in place: ``pread`` locally, ranged reads remotely (neighbours coalesced).
A compressed MDS file (``zip_data``, gz or bz2) is decompressed whole, bounded by the raw size
its index records, and kept in a per-process LRU of ``MAX_DECOMPRESSED_BYTES`` (at least the
most recent file), so open shards never hold more than that between them.
"""

from __future__ import annotations

import logging
import os
import posixpath
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import fsspec

from stallfree.errors import (
    CorruptShardError,
    IndexMismatchError,
    MissingShardError,
    ShardError,
    WriteError,
)
from stallfree.shards.formats import ScannedFiles, ShardCheck, ShardOpen
from stallfree.shards.manifest.model import MAX_COUNT
from stallfree.shards.manifest.shard_info import ShardInfo
from stallfree.shards.naming import check_key
from stallfree.shards.scan import SHARD_MISSING, record_mismatches, relative
from stallfree.shards.sources.base import SourceError, SourceReadError
from stallfree.shards.sources.offsets import ShardFile, decompress, parse_table, refuse_link_out
from stallfree.shards.tar.writer import encode_value
from stallfree.shards.verify_report import KeyAt, VerifyReport
from stallfree.storage import remote, stamps
from stallfree.storage.fs import file_size, is_local
from stallfree.storage.jsonfile import parse_json
from stallfree.storage.ranges import coalesce

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"
# Decompressed MDS files kept per process, between all open shards (the most recent one always).
MAX_DECOMPRESSED_BYTES = 512 << 20
_HEAD = 64 << 10  # a remote file's first read: its count and, usually, its whole offset table


@dataclass(frozen=True)
class InPlaceShard:
    """One file of an in-place dataset, as its index describes it: ``rel`` (its path under the
    dataset root: the manifest's shard path), the ``file`` (path, samples, compression),
    ``first`` (the global number of its first sample: default keys), ``entry`` (what the index
    says of it, canonical JSON: stamped into the manifest) and ``decode`` (a sample's bytes ->
    ``{field: value}``, the sharding source's own decoder)."""

    rel: str
    file: ShardFile
    first: int
    entry: str
    decode: Callable[[bytes, str], dict[str, Any]]
    keyed: bool = False  # a ``__key__`` / ``key`` column names the samples
    other: ShardFile | None = None  # its other file (MDS: raw and compressed), not chosen here


@dataclass(frozen=True)
class IndexedFile:
    """What a format's ``parse`` says of one file: the file, its entry (canonical JSON), its
    decoder, and whether a column names its samples' keys."""

    file: ShardFile
    entry: str
    decode: Callable[[bytes, str], dict[str, Any]]
    keyed: bool
    other: ShardFile | None = None


@dataclass(frozen=True)
class ParsedIndex:
    """A dataset's ``index.json``, parsed: its shards in order and by path, and the fields its
    samples have (in the order the manifest lists them)."""

    path: str
    shards: tuple[InPlaceShard, ...]
    fields: tuple[str, ...]

    def shard(self, rel: str) -> InPlaceShard | None:
        """The shard whose file is ``rel``: the file chosen here, or the other one the index
        names for it (a dataset opened where the other was the one present)."""
        by_rel = self.__dict__.get("_by_rel")
        if by_rel is None:
            by_rel = {s.rel: s for s in self.shards}
            root = self.path[: -len(INDEX_NAME)]
            for s in self.shards:
                if s.other is not None:
                    alias = relative(root.rstrip("/"), s.other.path) if root else s.other.path
                    by_rel.setdefault(alias, replace(s, rel=alias, file=s.other, other=s.file))
            object.__setattr__(self, "_by_rel", by_rel)
        return by_rel.get(rel)


# (index object, root, index path, local, exists) -> (its files, the samples' fields)
Parse = Callable[[Any, str, str, bool, Callable[[str], bool]], tuple[list[IndexedFile], list[str]]]


def sample_fields(names: Sequence[str]) -> list[str]:
    """The manifest's fields for columns ``names``: what a tar shard of its samples holds
    (``__key__`` is the key; ``_``-prefixed columns are not written), sorted as tar members are."""
    return sorted(n for n in names if n != "__key__" and not n.startswith("_"))


def _where(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if is_local(fs) else fs.unstrip_protocol(path)


def _lister(fs: fsspec.AbstractFileSystem, root: str) -> Callable[[str], bool]:
    """``exists(path)`` for files under ``root``: one listing for a remote store, asked only if
    needed (an MDS shard listing both a raw and a compressed file)."""
    if is_local(fs):
        return os.path.exists
    names: set[str] | None = None

    def exists(path: str) -> bool:
        nonlocal names
        if names is None:
            try:
                names = {p.rstrip("/") for p in fs.find(root)}
            except (OSError, ValueError):
                names = set()
        return path in names

    return exists


def parse_index(fs: fsspec.AbstractFileSystem, root: str, parse: Parse, what: str) -> ParsedIndex:
    """Read and parse ``root/index.json`` with a format's ``parse``; ``MissingShardError`` when it
    is not there, a ``ShardError`` naming the file for anything wrong in it."""
    local = is_local(fs)
    path = posixpath.join(root, INDEX_NAME) if root else INDEX_NAME
    name = _where(fs, path)
    if local:
        refuse_link_out(root, path, f"the {what} index")
    data = remote.read_file(fs, path, shard=INDEX_NAME)
    obj = parse_json(data, name)
    try:
        shards, fields = parse(obj, root, name, local, _lister(fs, root))
    except (TypeError, AttributeError, KeyError, ValueError) as exc:
        if isinstance(exc, ShardError):
            raise
        raise SourceError(f"{name}: not a {what} index ({type(exc).__name__}: {exc})") from None
    out, first = [], 0
    for f in shards:
        out.append(
            InPlaceShard(relative(root, f.file.path), f.file, first, f.entry, f.decode, f.keyed, f.other)
        )
        first += f.file.samples
    if first > MAX_COUNT:  # len() of the dataset would be an OverflowError naming nothing
        raise SourceError(f"{name}: its files hold {first} samples in all, more than any dataset can")
    rels = [s.rel for s in out]
    if len(set(rels)) != len(rels):
        raise SourceError(f"{name}: lists one file as two shards")
    return ParsedIndex(path, tuple(out), tuple(fields))


class _IndexCache:
    """Parsed indexes per process, so opening a dataset's 10,000 shards parses its index once.
    A local index is parsed again when its file changes (size, mtime, inode); a remote one is
    kept for the process (each shard's entry is still checked against the dataset's stamp)."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._parsed: OrderedDict[tuple[Any, ...], ParsedIndex] = OrderedDict()

    def get(self, fs: fsspec.AbstractFileSystem, root: str, parse: Parse, what: str) -> ParsedIndex:
        path = posixpath.join(root, INDEX_NAME)
        key: tuple[Any, ...] = (what, _where(fs, path))
        if is_local(fs):
            try:
                st = os.stat(path)
            except OSError:
                st = None
            key += (st.st_size, st.st_mtime_ns, st.st_ino) if st is not None else (None,)
        with self._lock:
            found = self._parsed.get(key)
            if found is not None:
                self._parsed.move_to_end(key)
                return found
        parsed = parse_index(fs, root, parse, what)
        with self._lock:
            self._parsed[key] = parsed
            while len(self._parsed) > self._size:
                self._parsed.popitem(last=False)
        return parsed


_INDEXES = _IndexCache()


class _Decompressed:
    """Decompressed files, most recently used last, at most ``limit`` bytes between them (the
    most recent one is kept whatever its size); per process, shared by every open reader."""

    def __init__(self, limit: int = MAX_DECOMPRESSED_BYTES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._blobs: OrderedDict[object, bytes] = OrderedDict()
        self._bytes = 0

    def get(self, token: object) -> bytes | None:
        with self._lock:
            blob = self._blobs.get(token)
            if blob is not None:
                self._blobs.move_to_end(token)
            return blob

    def put(self, token: object, blob: bytes) -> None:
        with self._lock:
            old = self._blobs.pop(token, None)
            self._bytes -= len(old) if old is not None else 0
            self._blobs[token] = blob
            self._bytes += len(blob)
            while self._bytes > self.limit and len(self._blobs) > 1:
                _, dropped = self._blobs.popitem(last=False)
                self._bytes -= len(dropped)

    def drop(self, token: object) -> None:
        with self._lock:
            old = self._blobs.pop(token, None)
            self._bytes -= len(old) if old is not None else 0


DECOMPRESSED = _Decompressed()


def _typed(exc: SourceError, shard: str, key: str | None = None) -> ShardError:
    """A source's error as the dataset's: ``CorruptShardError`` naming the shard (and the sample
    and byte offset where known)."""
    if isinstance(exc, SourceReadError):
        return CorruptShardError(exc.reason, shard=shard, key=key or exc.key, offset=exc.offset)
    return exc


class OffsetShardReader:
    """Random access to one MDS shard or LitData chunk (``ShardReader``)."""

    def __init__(self, request: ShardOpen, parse: Parse, what: str) -> None:
        self.fs, self.path, self.info = request.fs, request.path, request.info
        self.shard = self.info.path
        self.local = is_local(self.fs)
        self._token = object()
        self._file: Any = None
        self._fd: int | None = None
        root = _root_of(self.path, self.shard)
        try:
            index = _INDEXES.get(self.fs, root, parse, what)
        except MissingShardError:
            raise MissingShardError(
                f"no {INDEX_NAME} beside the shard ({_where(self.fs, posixpath.join(root, INDEX_NAME))})",
                shard=self.shard,
            ) from None
        found = index.shard(self.shard)
        if found is None:
            raise IndexMismatchError(f"{index.path} no longer lists this shard", shard=self.shard)
        self._check_entry(found)
        self.layout = found
        self.file = ShardFile(self.path, found.file.samples, found.file.compression, found.file.raw_bytes)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _check_entry(self, found: InPlaceShard) -> None:
        """The index still says of this shard what it said when the dataset was opened (its
        entry's hash is in the shard's stamp): a dataset rewritten under a running job is an
        error, not samples decoded with another layout."""
        stamp = self.info.stamp
        if stamp is None or ";idx=" not in stamp:
            return
        now = stamps.stamp(0, None, found.entry).rsplit(";idx=", 1)[1]
        if stamp.rsplit(";idx=", 1)[1] != now:
            raise IndexMismatchError(
                f"{INDEX_NAME} changed since the dataset was opened (its entry for this shard differs): "
                "open the dataset again",
                shard=self.shard,
            )

    def _open(self) -> None:
        shard, info = self.shard, self.info
        if self.local:
            refuse_link_out(_root_of(self.path, shard), self.path, f"{INDEX_NAME} shard {shard}")
            try:
                self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed with the reader
            except FileNotFoundError:
                raise MissingShardError("shard not found", shard=shard) from None
            self._fd = self._file.fileno()
            self.size = os.fstat(self._fd).st_size
        else:
            self.size = file_size(self.fs, self.path, shard=shard, missing=SHARD_MISSING)
        found = record_mismatches(info, self.size)
        if found:
            raise found[0]
        self._offsets: list[int] | None = None
        if not self.file.compression:  # (a compressed file's table is read with its first sample:
            self._table()  # opening it for ``key_of`` must not decompress it)

    def _table(self) -> list[int]:
        """The file's offsets: its table, read (and checked against the index) once."""
        if self._offsets is not None:
            return self._offsets
        try:
            if self.file.compression:
                blob = self._blob()
                offsets = parse_table(blob, self.path, len(blob), self.file.samples)
            else:
                head = self._read(0, min(self.size, 4 if self.local else _HEAD))
                n = int.from_bytes(head[:4], "little") if len(head) >= 4 else 0
                need = min(self.size, 4 * (n + 2))
                if len(head) < need:
                    head += self._read(len(head), need)
                offsets = parse_table(head, self.path, self.size, self.file.samples)
        except SourceReadError as exc:
            raise _typed(exc, self.shard) from None
        self._offsets = offsets
        return offsets

    def _blob(self) -> bytes:
        """The decompressed file, from the process's LRU or decompressed (bounded) again."""
        blob = DECOMPRESSED.get(self._token)
        if blob is None:
            data = self._read(0, self.size)
            try:
                blob = decompress(data, self.file)
            except SourceReadError as exc:
                raise _typed(exc, self.shard) from None
            DECOMPRESSED.put(self._token, blob)
        return blob

    def _read(self, start: int, end: int, key: str | None = None) -> bytes:
        if self._fd is not None:
            data = os.pread(self._fd, end - start, start)
            if len(data) != end - start:
                raise CorruptShardError(
                    f"file ends at byte {start + len(data)}, the offsets say data runs to {end} "
                    "(cut short after it was opened)",
                    shard=self.shard,
                    key=key,
                    offset=start + len(data),
                )
            return data
        return remote.read_range(self.fs, self.path, start, end, shard=self.shard, key=key)

    def __len__(self) -> int:
        return self.file.samples  # what the index promises (the table is checked against it)

    def key_of(self, row: int) -> str | None:
        """The global sample number, zero-padded, unless a column names the keys (then None:
        telling would take a read)."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for shard {self.shard} of {len(self)}")
        return None if self.layout.keyed else f"{self.layout.first + row:09d}"

    def _span(self, row: int) -> tuple[int, int]:
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for shard {self.shard} of {len(self)}")
        offsets = self._table()
        return offsets[row], offsets[row + 1]

    def _sample(self, row: int, data: bytes, offset: int) -> dict[str, Any]:
        """Row's bytes -> the sample a tar shard of it would give."""
        label = f"{self.shard} sample {row}"
        try:
            fields = self.layout.decode(data, label)
        except (ValueError, struct.error, IndexError, KeyError, TypeError, OverflowError) as exc:
            raise CorruptShardError(f"sample {row}: {exc}", shard=self.shard, offset=offset) from None
        number = self.layout.first + row
        key = fields.pop("__key__", None)
        if key is None:
            key = fields.get("key")
        key = str(key) if key is not None else f"{number:09d}"
        try:
            check_key(key)
            sample: dict[str, Any] = {"__key__": key}
            for name in sorted(fields):
                value = fields[name]
                if value is not None and not name.startswith("_"):
                    sample[name] = encode_value(value, name, key)
        except WriteError as exc:
            raise CorruptShardError(
                f"sample {row}: {exc.reason}", shard=self.shard, key=key, offset=offset
            ) from None
        return sample

    def get(self, row: int) -> dict[str, Any]:
        start, end = self._span(row)
        if self.file.compression:
            blob = self._blob()
            return self._sample(row, blob[start:end], start)
        return self._sample(row, self._read(start, end), start)

    def get_many(self, rows: list[int]) -> list[dict[str, Any]]:
        """Samples for ``rows`` in order; remotely, neighbours share one ranged read."""
        if self._fd is not None or self.file.compression or len(rows) < 2:
            return [self.get(r) for r in rows]
        groups = coalesce([(*self._span(r), r) for r in set(rows)])
        blobs = remote.read_ranges(self.fs, self.path, [(g[0], g[1]) for g in groups], shard=self.shard)
        found: dict[int, dict[str, Any]] = {}
        for (base, _, tags), blob in zip(groups, blobs, strict=True):
            for r in tags:
                start, end = self._span(r)
                found[r] = self._sample(r, blob[start - base : end - base], start)
        out, handed = [], set()
        for r in rows:  # a row asked for twice gets its own dict the second time (callers may mutate)
            out.append(found[r] if r not in handed else dict(found[r]))
            handed.add(r)
        return out

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        for row in range(len(self)):
            yield self.get(row)

    def close(self) -> None:
        DECOMPRESSED.drop(self._token)
        if self._file is not None:
            self._file.close()
            self._file, self._fd = None, None


def _root_of(path: str, rel: str) -> str:
    """The dataset root of shard ``path`` whose manifest path is ``rel``."""
    if path == rel:
        return ""
    if path.endswith("/" + rel):
        return path[: -len(rel) - 1]
    return posixpath.dirname(path)


class OffsetFormat:
    """What the format registry knows of a dataset read in place: never written (``stallfree
    shard`` of the directory gives a dataset with a manifest and sha256), its index is the
    ``index.json`` beside its files, its samples' fields are bytes."""

    scan_suffixes: tuple[str, ...] = ()
    shard_overhead = 0
    checksums = None
    typed_fields = False
    indexable = False
    # what ``open_dataset``'s advice re-shards it to (tar: the bytes these samples already are)
    reshard_format = "tar"

    def __init__(
        self, name: str, suffix: str, what: str, parse: Parse, accepts: Callable[[Any], bool]
    ) -> None:
        self.name, self.suffix, self.what = name, suffix, what
        self.parse, self.accepts = parse, accepts

    def sidecars(self, path: str, with_checksums: bool = True) -> list[str]:
        return [posixpath.join(posixpath.dirname(path), INDEX_NAME)]

    def item_cost(self, sizes: Sequence[int]) -> int:
        return sum(sizes)

    def _read_only(self) -> WriteError:
        return WriteError(
            f"{self.what} datasets are read in place, not written: write tar or arrow shards "
            f"(`stallfree shard SRC DST`)"
        )

    def prepare(self, sample: dict[str, Any]) -> Any:
        raise self._read_only()

    def writer(
        self, path: str, fs: fsspec.AbstractFileSystem, *, schema: Any = None, overlap_hash: bool = False
    ) -> Any:
        raise self._read_only()

    def source_schema(self, source: Any) -> None:
        return None

    def open_reader(self, request: ShardOpen) -> OffsetShardReader:
        return OffsetShardReader(request, self.parse, self.what)

    def verify(self, check: ShardCheck, report: VerifyReport) -> list[KeyAt]:
        """Open the shard (size, offset table, index entry) and decode every sample."""
        found: list[KeyAt] = []
        try:
            reader = self.open_reader(ShardOpen(check.fs, check.path, check.info))
        except ShardError as exc:
            report.errors.append(exc)
            return found
        try:
            report.bytes += reader.size
            if check.progress is not None:
                check.progress(reader.size)
            try:
                reader._table()  # a file whose table (or compressed stream) is bad: one error
            except ShardError as exc:
                report.errors.append(exc)
                return found
            for row in range(len(reader)):
                try:
                    sample = reader.get(row)
                except ShardError as exc:
                    report.errors.append(exc)
                    continue
                found.append((sample["__key__"], None))
        finally:
            reader.close()
        return found

    def scan(self, fs: fsspec.AbstractFileSystem, root: str, paths: list[str]) -> ScannedFiles:
        """The dataset ``root/index.json`` describes, as manifest rows: every file stamped with
        the store's version of it and its entry's hash (so the fingerprint follows both)."""
        index = _INDEXES.get(fs, root, self.parse, self.what)  # (this process's readers then reuse it)
        shards, unversioned = [], []
        for s in index.shards:
            size, version = stamps.store_version(fs, s.file.path, s.rel)
            if version is None:
                unversioned.append(s.rel)
            shards.append(
                ShardInfo(s.rel, s.file.samples, size, None, stamp=stamps.stamp(size, version, s.entry))
            )
        stamps.warn_unversioned(fs.unstrip_protocol(root or "/"), unversioned)
        return ScannedFiles(shards, list(index.fields))


__all__ = [
    "DECOMPRESSED",
    "INDEX_NAME",
    "MAX_DECOMPRESSED_BYTES",
    "InPlaceShard",
    "IndexedFile",
    "OffsetFormat",
    "OffsetShardReader",
    "ParsedIndex",
    "parse_index",
    "sample_fields",
]
