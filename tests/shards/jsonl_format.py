"""A toy third shard format, in one file: what ``docs/ARCHITECTURE.md`` promises a new format
takes ("one folder plus one registry line"; ``tests/shards/test_toy_format.py`` adds the line).

A "jsonl" shard is one JSON object per line, ``{"__key__": KEY, FIELD: TEXT, ...}``; a field's
bytes are stored as their UTF-8 text and come back as the same bytes. No sidecar: a reader
without an index walks the file once and keeps each line's byte range. Shards opened without a
manifest (``scan``) get that index made by the scan, an opaque ``LineIndex`` the dataset hands
back in ``ShardOpen.index`` (and pickles into loader workers) without knowing what it is.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from stallfree.errors import CorruptShardError, DuplicateKeyError, IndexMismatchError, WriteError
from stallfree.shards.formats import ScannedFiles, ShardCheck, ShardOpen
from stallfree.shards.manifest.shard_info import ShardInfo
from stallfree.shards.naming import check_field, check_key
from stallfree.shards.scan import SHARD_MISSING, record_mismatches, relative
from stallfree.shards.verify_report import KeyAt, VerifyReport
from stallfree.storage import remote
from stallfree.storage.atomic import atomic_write_bytes
from stallfree.storage.fs import file_size

KEY = "__key__"
MAX_SHARD_BYTES = 64 << 20  # a toy: a shard is read whole to be indexed or verified
MAX_DEPTH = 2  # a line is a flat object of strings


@dataclass(frozen=True)
class LineIndex:
    """Where each sample's line lies in one shard: the format's own index (opaque to the rest)."""

    keys: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class JsonlRow:
    """A sample checked and encoded once: its line, with the bytes it takes."""

    key: str
    fields: tuple[str, ...]
    line: bytes

    @property
    def nbytes(self) -> int:
        return len(self.line)


def _parse_line(line: bytes, shard: str, offset: int) -> dict[str, Any]:
    """One line as a sample; CorruptShardError naming the shard and the line's byte offset."""
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptShardError(f"line is not JSON: {exc}", shard=shard, offset=offset) from None
    if not isinstance(obj, dict) or not isinstance(obj.get(KEY), str):
        raise CorruptShardError(f"line is not an object with a string {KEY}", shard=shard, offset=offset)
    if not all(isinstance(v, str) for v in obj.values()):
        raise CorruptShardError("a field is not a string", shard=shard, key=obj[KEY], offset=offset)
    return obj


def index_lines(data: bytes, shard: str) -> LineIndex:
    """The index of a whole shard's bytes: each line parsed (keys checked), its range kept."""
    keys, spans, start = [], [], 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end + 1
        keys.append(_parse_line(data[start:end], shard, start)[KEY])
        spans.append((start, end))
        start = end
    return LineIndex(tuple(keys), tuple(spans))


def _read_whole(fs: fsspec.AbstractFileSystem, path: str, shard: str) -> bytes:
    size = file_size(fs, path, shard=shard, missing=SHARD_MISSING)
    if size > MAX_SHARD_BYTES:
        raise CorruptShardError(f"{size} bytes: a jsonl shard holds at most {MAX_SHARD_BYTES}", shard=shard)
    return remote.read_file(fs, path, shard=shard, size=size)


class JsonlWriter:
    """One shard, written whole on ``close`` under a temp name and renamed into place."""

    field_types = None
    schema = None

    def __init__(self, path: str, fs: fsspec.AbstractFileSystem) -> None:
        self.path, self.fs, self.name = path, fs, posixpath.basename(path)
        self._lines: list[bytes] = []
        self._keys: set[str] = set()
        self._fields: dict[str, None] = {}
        self.info: ShardInfo | None = None

    @property
    def samples(self) -> int:
        return len(self._lines)

    @property
    def bytes(self) -> int:
        return sum(len(line) for line in self._lines)

    @property
    def fields(self) -> list[str]:
        return list(self._fields)

    def write(self, sample: dict[str, Any]) -> int:
        return self.write_prepared(JSONL.prepare(sample))

    def write_prepared(self, row: JsonlRow) -> int:
        if row.key in self._keys:
            raise DuplicateKeyError("duplicate sample key in shard", shard=self.name, key=row.key)
        self._keys.add(row.key)
        self._lines.append(row.line)
        self._fields.update(dict.fromkeys(row.fields))
        return row.nbytes

    def close(self) -> ShardInfo:
        if self.info is None:
            data = b"".join(self._lines)
            digest = atomic_write_bytes(self.fs, self.path, data)
            self.info = ShardInfo(self.name, len(self._lines), len(data), digest)
        return self.info

    def abort(self) -> None:
        self._lines.clear()  # nothing reaches storage before close


class JsonlReader:
    """Random access to one shard through its ``LineIndex`` (given, or made by reading it once)."""

    def __init__(self, request: ShardOpen) -> None:
        self.fs, self.path, self.shard = request.fs, request.path, request.info.path
        self.index: LineIndex | None = request.index
        if self.index is None:
            data = _read_whole(self.fs, self.path, self.shard)
            found = record_mismatches(request.info, len(data))
            if found:
                raise found[0]
            self.index = index_lines(data, self.shard)
        if len(self.index.keys) != request.info.samples:
            raise IndexMismatchError(
                f"{len(self.index.keys)} lines, the manifest says {request.info.samples}", shard=self.shard
            )

    def __len__(self) -> int:
        return len(self.index.keys)

    def key_of(self, row: int) -> str:
        return self.index.keys[row]

    def get(self, row: int) -> dict[str, Any]:
        start, end = self.index.spans[row]
        line = remote.read_range(self.fs, self.path, start, end, shard=self.shard, key=self.index.keys[row])
        obj = _parse_line(line, self.shard, start)
        if obj[KEY] != self.index.keys[row]:
            raise CorruptShardError(
                f"line holds key {obj[KEY]!r}, the index says {self.index.keys[row]!r}",
                shard=self.shard,
                offset=start,
            )
        return {k: (v if k == KEY else v.encode()) for k, v in obj.items()}

    def get_many(self, rows: list[int]) -> list[dict[str, Any]]:
        return [self.get(r) for r in rows]

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        return (self.get(r) for r in range(len(self)))

    def close(self) -> None:
        pass


class JsonlFormat:
    name = "jsonl"
    suffix = ".jsonl"
    scan_suffixes = (".jsonl",)  # a directory of them opens without a manifest
    shard_overhead = 0
    checksums = None
    typed_fields = False
    indexable = False

    def sidecars(self, path: str, with_checksums: bool = True) -> list[str]:
        return []

    def item_cost(self, sizes: Sequence[int]) -> int:
        return 16 + sum(s + 8 for s in sizes)

    def prepare(self, sample: dict[str, Any]) -> JsonlRow:
        if not isinstance(sample, dict):
            raise WriteError(f"a sample must be a dict, got {type(sample).__name__}")
        key = check_key(sample.get(KEY))
        obj: dict[str, str] = {KEY: key}
        for field, value in sample.items():
            if field == KEY:
                continue
            check_field(field, key)
            if not isinstance(value, bytes):
                raise WriteError(f"field {field!r}: a jsonl shard stores bytes", key=key)
            try:
                obj[field] = value.decode("utf-8")
            except UnicodeDecodeError:
                raise WriteError(f"field {field!r}: a jsonl shard stores UTF-8 text", key=key) from None
        if len(obj) == 1:
            raise WriteError("sample has no fields besides '__key__'", key=key)
        line = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        return JsonlRow(key, tuple(f for f in obj if f != KEY), line)

    def writer(
        self, path: str, fs: fsspec.AbstractFileSystem, *, schema: Any = None, overlap_hash: bool = False
    ) -> JsonlWriter:
        return JsonlWriter(path, fs)

    def source_schema(self, source: Any) -> None:
        return None

    def open_reader(self, request: ShardOpen) -> JsonlReader:
        return JsonlReader(request)

    def verify(self, check: ShardCheck, report: VerifyReport) -> list[KeyAt]:
        shard = check.info.path
        data = _read_whole(check.fs, check.path, shard)
        report.bytes += len(data)
        digest = hashlib.sha256(data).hexdigest() if check.hashes else None
        report.errors.extend(record_mismatches(check.info, len(data), digest))
        try:
            index = index_lines(data, shard)
        except CorruptShardError as exc:
            report.errors.append(exc)
            return []
        seen: set[str] = set()
        for key in index.keys:
            if key in seen:
                report.errors.append(DuplicateKeyError("duplicate sample key in shard", shard=shard, key=key))
            seen.add(key)
        if len(index.keys) != check.info.samples:
            report.errors.append(
                IndexMismatchError(
                    f"{len(index.keys)} lines, the manifest says {check.info.samples}", shard=shard
                )
            )
        report.samples += len(index.keys)
        return [(key, start) for key, (start, _) in zip(index.keys, index.spans, strict=True)]

    def scan(self, fs: fsspec.AbstractFileSystem, root: str, paths: list[str]) -> ScannedFiles:
        shards, indices, fields = [], [], {}
        for path in paths:
            rel = relative(root, path)
            data = _read_whole(fs, path, rel)
            index = index_lines(data, rel)
            for start, end in index.spans[:1]:
                fields.update(dict.fromkeys(k for k in json.loads(data[start:end]) if k != KEY))
            shards.append(ShardInfo(rel, len(index.keys), len(data), None))
            indices.append(index)
        return ScannedFiles(shards, list(fields), indices)


JSONL = JsonlFormat()
