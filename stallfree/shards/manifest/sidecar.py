"""The binary sidecar of a big ``manifest.json``: its shard table in columns, read without JSON.

``manifest.json`` stays the dataset's truth: every tool reads it, and writing it is the commit
point. Beside a big one (``SIDECAR_MIN_BYTES``, about 25,000 shards) ``Manifest.save`` also writes
``manifest.shards.bin``: the rest of the manifest as JSON, the shard table as columns, the
fingerprint, and the size and sha256 of the ``manifest.json`` it was made from. Opening reads
both files, hashes the JSON instead of parsing it, and builds a ``ShardInfo`` only when one is
asked for (``ShardTable``): parsing 200,000 shards' JSON and holding their objects is what cost
0.96 s and 178 MiB (``benchmarks/bench_manifest.py`` measures both ways side by side).

Layout, little-endian:
  header (64 bytes): magic ``SFMSHARD``, format version u32, section count u32, shard count u64,
      manifest.json size u64, manifest.json sha256 (32 bytes)
  directory: per section, its length u64 and crc32 u32
  sections, in ``SECTIONS`` order: meta (JSON object: ``manifest``, the manifest without
      ``shards``, and ``fingerprint``), flags u8[n] (bit 0: sha256 known, bit 1: stamp known,
      bit 2: xxh3_128 known), samples i64[n], bytes i64[n], sha256 (32 raw bytes each, zeros where
      unknown), path offsets u64[n+1], paths (UTF-8), stamp offsets u64[n+1], stamps (UTF-8),
      and from format 2 on xxh3_128 (16 raw bytes each, zeros where unknown)

Format 1 (no xxh3_128 section) is still read. A sidecar made from another ``manifest.json``
(stale: the manifest was rewritten without it) or by a newer format is ignored with a warning,
and the JSON is parsed. A damaged one (truncated, a
checksum that does not match, offsets that do not add up) raises ``ManifestError`` naming the file
and the byte offset: never wrong data. Nothing here is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, overload

import numpy as np

from stallfree.errors import ManifestError
from stallfree.shards.manifest.paths import check_path_blob
from stallfree.shards.manifest.shard_info import ShardInfo
from stallfree.storage.jsonfile import parse_json

log = logging.getLogger(__name__)

SIDECAR_SUFFIX = ".shards.bin"  # manifest.json -> manifest.shards.bin
SIDECAR_MIN_BYTES = 4 << 20  # below this the JSON parses in ~0.1 s: one file is simpler
MAGIC = b"SFMSHARD"
VERSION = 2
SECTIONS_V1 = (
    "meta",
    "flags",
    "samples",
    "bytes",
    "sha256",
    "path_offsets",
    "paths",
    "stamp_offsets",
    "stamps",
)
SECTIONS = (*SECTIONS_V1, "xxh3_128")
SECTIONS_OF = {1: SECTIONS_V1, 2: SECTIONS}  # what each format this stallfree reads holds
HAS_SHA256, HAS_STAMP, HAS_XXH3 = 1, 2, 4
_KNOWN_FLAGS = {1: HAS_SHA256 | HAS_STAMP, 2: HAS_SHA256 | HAS_STAMP | HAS_XXH3}
_HEADER = struct.Struct("<8sIIQQ32s")
_ENTRY = struct.Struct("<QI")
_NO_SHA = bytes(32)
_NO_XXH3 = bytes(16)


def sidecar_path_for(manifest_path: str) -> str:
    """``.../manifest.json`` -> ``.../manifest.shards.bin``."""
    stem = manifest_path[:-5] if manifest_path.endswith(".json") else manifest_path
    return stem + SIDECAR_SUFFIX


class ShardTable(Sequence[ShardInfo]):
    """A manifest's shards as columns over the sidecar's bytes: ``table[i]`` builds that one
    ``ShardInfo``; the totals and per-shard counts come from the columns without building any."""

    def __init__(
        self,
        flags: np.ndarray,
        samples: np.ndarray,
        sizes: np.ndarray,
        sha256: memoryview,
        path_offsets: np.ndarray,
        paths: memoryview,
        stamp_offsets: np.ndarray,
        stamps: memoryview,
        fingerprint: tuple[tuple[Any, ...], str] | None = None,
        xxh3_128: memoryview | None = None,
    ) -> None:
        self._flags, self._samples, self._sizes, self._sha = flags, samples, sizes, sha256
        self._path_offsets, self._paths = path_offsets, paths
        self._stamp_offsets, self._stamps = stamp_offsets, stamps
        self._fingerprint = fingerprint
        self._fast = xxh3_128

    def __len__(self) -> int:
        return len(self._samples)

    @overload
    def __getitem__(self, i: int) -> ShardInfo: ...
    @overload
    def __getitem__(self, i: slice) -> list[ShardInfo]: ...
    def __getitem__(self, i: int | slice) -> ShardInfo | list[ShardInfo]:
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"shard {i} out of range for {n} shards")
        return self._row(j)

    def _row(self, j: int) -> ShardInfo:
        flags = int(self._flags[j])
        sha = self._sha[32 * j : 32 * j + 32].hex() if flags & HAS_SHA256 else None
        stamp = None
        if flags & HAS_STAMP:
            stamp = bytes(self._stamps[self._stamp_offsets[j] : self._stamp_offsets[j + 1]]).decode()
        path = bytes(self._paths[self._path_offsets[j] : self._path_offsets[j + 1]]).decode()
        fast = self._fast[16 * j : 16 * j + 16].hex() if flags & HAS_XXH3 and self._fast is not None else None
        return ShardInfo(path, int(self._samples[j]), int(self._sizes[j]), sha, stamp, fast)

    def __iter__(self) -> Iterator[ShardInfo]:
        return (self._row(j) for j in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # compared like the list it stands for

    def sample_counts(self) -> list[int]:
        """Every shard's sample count, in order (no ``ShardInfo`` built)."""
        return self._samples.tolist()

    @property
    def total_samples(self) -> int:
        return int(self._samples.sum(dtype=np.int64))

    @property
    def total_bytes(self) -> int:
        return int(self._sizes.sum(dtype=np.int64))

    def fingerprint_for(self, version: int, fmt: str, fields: Sequence[str]) -> str | None:
        """The fingerprint recorded when the sidecar was written, if it was for this version,
        format and fields (the rest of what it hashes is this table): None otherwise."""
        if self._fingerprint is None:
            return None
        key, value = self._fingerprint
        return value if key == (version, fmt, tuple(fields)) else None


@dataclass(frozen=True)
class Sidecar:
    """What a sidecar holds: the manifest's JSON object without ``shards``, and the shard table."""

    manifest: dict[str, Any]
    shards: ShardTable


def encode(
    manifest: dict[str, Any], shards: Sequence[ShardInfo], fingerprint: str, manifest_bytes: bytes
) -> bytes:
    """The sidecar for ``manifest_bytes`` (the ``manifest.json`` text as written): ``manifest`` is
    its JSON object (``shards`` is left out), ``fingerprint`` the manifest's."""
    n = len(shards)
    head = {k: v for k, v in manifest.items() if k != "shards"}
    meta = json.dumps({"manifest": head, "fingerprint": fingerprint}, separators=(",", ":")).encode()
    flags = np.fromiter(
        (
            (HAS_SHA256 if s.sha256 is not None else 0)
            | (HAS_STAMP if s.stamp is not None else 0)
            | (HAS_XXH3 if s.xxh3_128 is not None else 0)
            for s in shards
        ),
        np.uint8,
        n,
    )
    samples = np.fromiter((s.samples for s in shards), np.int64, n)
    sizes = np.fromiter((s.bytes for s in shards), np.int64, n)
    sha = b"".join(bytes.fromhex(s.sha256) if s.sha256 is not None else _NO_SHA for s in shards)
    path_offsets, paths = _blob(s.path for s in shards)
    stamp_offsets, stamps = _blob(s.stamp or "" for s in shards)
    fast = b"".join(bytes.fromhex(s.xxh3_128) if s.xxh3_128 is not None else _NO_XXH3 for s in shards)
    sections = [
        meta,
        flags.tobytes(),
        samples.astype("<i8").tobytes(),
        sizes.astype("<i8").tobytes(),
        sha,
        path_offsets,
        paths,
        stamp_offsets,
        stamps,
        fast,
    ]
    digest = hashlib.sha256(manifest_bytes).digest()
    out = [_HEADER.pack(MAGIC, VERSION, len(sections), n, len(manifest_bytes), digest)]
    out += [_ENTRY.pack(len(b), zlib.crc32(b)) for b in sections]
    return b"".join(out + sections)


def _blob(texts: Iterator[str]) -> tuple[bytes, bytes]:
    """UTF-8 of ``texts`` end to end, and the u64 offsets of their starts plus the end."""
    parts = [t.encode() for t in texts]
    offsets = np.zeros(len(parts) + 1, np.uint64)
    np.cumsum(np.fromiter(map(len, parts), np.uint64, len(parts)), out=offsets[1:])
    return offsets.astype("<u8").tobytes(), b"".join(parts)


def decode(data: bytes, where: str, manifest_bytes: bytes) -> Sidecar | None:
    """The sidecar ``data`` (read from ``where``) for ``manifest_bytes``; None (with a warning) if
    it was made from another manifest or by a newer format. Raises ``ManifestError`` with the
    byte offset if it is damaged."""
    if len(data) < _HEADER.size:
        _damaged(where, f"ends at byte {len(data)}, inside its {_HEADER.size}-byte header", len(data))
    magic, version, count, n, json_size, json_sha = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        _damaged(where, f"does not start with {MAGIC.decode()!r}: not a manifest sidecar", 0)
    names = SECTIONS_OF.get(version)
    if names is None:
        log.warning(
            "%s: sidecar format %d is not one this stallfree reads (%s): reading the JSON",
            where,
            version,
            ", ".join(map(str, SECTIONS_OF)),
        )
        return None
    if json_size != len(manifest_bytes) or json_sha != hashlib.sha256(manifest_bytes).digest():
        log.warning(
            "%s was made from another manifest.json (it was rewritten since): reading the JSON; "
            "saving the manifest again rewrites the sidecar",
            where,
        )
        return None
    if count != len(names):
        _damaged(where, f"lists {count} sections, format {version} has {len(names)}", 12)
    start = _HEADER.size + count * _ENTRY.size
    if len(data) < start:
        _damaged(
            where, f"ends at byte {len(data)}, inside its section directory (to byte {start})", len(data)
        )
    view = memoryview(data)
    sections: dict[str, memoryview] = {}
    for k, name in enumerate(names):
        length, crc = _ENTRY.unpack_from(data, _HEADER.size + k * _ENTRY.size)
        end = start + length
        if end > len(data):
            _damaged(
                where,
                f"ends at byte {len(data)}, inside section {name!r} ({start}-{end}): truncated",
                len(data),
            )
        part = view[start:end]
        if zlib.crc32(part) != crc:
            _damaged(where, f"section {name!r} (bytes {start}-{end}) fails its crc32: damaged", start)
        sections[name] = part
        start = end
    if start != len(data):
        _damaged(where, f"has {len(data) - start} bytes after its last section", start)
    return _build(sections, n, where, _offsets_of(data, names), _KNOWN_FLAGS[version])


def _offsets_of(data: bytes, names: Sequence[str]) -> dict[str, int]:
    """Each section's first byte, for error messages."""
    out, start = {}, _HEADER.size + len(names) * _ENTRY.size
    for k, name in enumerate(names):
        out[name] = start
        start += _ENTRY.unpack_from(data, _HEADER.size + k * _ENTRY.size)[0]
    return out


def _build(parts: dict[str, memoryview], n: int, where: str, at: dict[str, int], known: int) -> Sidecar:
    """Check the sections against each other (a sound crc does not prove a sound writer)."""
    for name, width in (
        ("flags", 1),
        ("samples", 8),
        ("bytes", 8),
        ("sha256", 32),
        ("path_offsets", 8),
        ("stamp_offsets", 8),
        ("xxh3_128", 16),
    ):
        if name not in parts:  # a format without it (1: no xxh3_128)
            continue
        want = width * (n + 1 if name.endswith("_offsets") else n)
        if len(parts[name]) != want:
            _damaged(
                where, f"section {name!r} holds {len(parts[name])} bytes, {n} shards need {want}", at[name]
            )
    flags = np.frombuffer(parts["flags"], np.uint8)
    samples = np.frombuffer(parts["samples"], "<i8")
    sizes = np.frombuffer(parts["bytes"], "<i8")
    for name, column in (("samples", samples), ("bytes", sizes)):
        bad = np.flatnonzero(column < 0)
        if bad.size:
            _damaged(where, f"shard {bad[0]}'s {name} is negative", at[name] + 8 * int(bad[0]))
        # totals are summed in int64 (ShardTable.total_*): one that would wrap is refused
        if column.size and column.sum(dtype=np.float64) >= 2.0**62 and sum(map(int, column)) >= 1 << 63:
            _damaged(where, f"the shards' {name} add up to more than a 64-bit count", at[name])
    if np.any(flags & ~np.uint8(known)):
        j = int(np.flatnonzero(flags & ~np.uint8(known))[0])
        _damaged(where, f"shard {j} has unknown flags {int(flags[j])}", at["flags"] + j)
    path_offsets = _check_blob(parts, "path_offsets", "paths", where, at, nonempty=None)
    check_path_blob(parts["paths"], path_offsets, where)  # as the JSON's paths are: inside the dataset
    stamp_offsets = _check_blob(
        parts, "stamp_offsets", "stamps", where, at, nonempty=(flags & HAS_STAMP) != 0
    )
    try:
        meta = parse_json(bytes(parts["meta"]), where)  # bounded depth: no RecursionError
    except ValueError as exc:  # (JSONFileError is one)
        _damaged(where, f"section 'meta' is not JSON: {exc}", at["meta"])
    if not isinstance(meta, dict) or not isinstance(meta.get("manifest"), dict):
        _damaged(where, "section 'meta' is not an object with a 'manifest' object", at["meta"])
    head, fingerprint = meta["manifest"], meta.get("fingerprint")
    recorded = None
    if isinstance(fingerprint, str) and isinstance(head.get("fields"), list):
        recorded = ((head.get("version"), head.get("format"), tuple(head["fields"])), fingerprint)
    table = ShardTable(
        flags,
        samples,
        sizes,
        parts["sha256"],
        path_offsets,
        parts["paths"],
        stamp_offsets,
        parts["stamps"],
        recorded,
        parts.get("xxh3_128"),
    )
    return Sidecar(head, table)


def _check_blob(
    parts: dict[str, memoryview],
    offsets_name: str,
    blob_name: str,
    where: str,
    at: dict[str, int],
    nonempty: np.ndarray | None,
) -> np.ndarray:
    """Offsets start at 0, never go back, end at the blob's length; the blob is UTF-8 and every
    piece starts on a character. Paths (``nonempty`` None) are never empty; stamps are empty
    exactly where their flag is off."""
    offsets = np.frombuffer(parts[offsets_name], "<u8")
    blob = parts[blob_name]
    lengths = np.diff(offsets.astype(np.int64))
    if offsets[0] != 0 or int(offsets[-1]) != len(blob) or np.any(lengths < 0):
        j = (
            int(np.flatnonzero(lengths < 0)[0]) + 1
            if np.any(lengths < 0)
            else (0 if offsets[0] else len(offsets) - 1)
        )
        _damaged(
            where,
            f"section {offsets_name!r} does not cut {blob_name!r} ({len(blob)} bytes) in order",
            at[offsets_name] + 8 * j,
        )
    empty = lengths == 0
    wrong = empty if nonempty is None else (empty == nonempty)
    if np.any(wrong):
        j = int(np.flatnonzero(wrong)[0])
        what = "an empty path" if nonempty is None else "a stamp that disagrees with its flag"
        _damaged(where, f"shard {j} has {what}", at[offsets_name] + 8 * j)
    try:
        bytes(blob).decode()
    except UnicodeDecodeError as exc:
        _damaged(where, f"section {blob_name!r} is not UTF-8: {exc.reason}", at[blob_name] + exc.start)
    raw = np.frombuffer(blob, np.uint8)
    used = np.flatnonzero(~empty)
    cut = (raw[offsets[used].astype(np.int64)] & 0xC0) == 0x80  # a UTF-8 continuation byte
    if np.any(cut):
        j = int(used[np.flatnonzero(cut)[0]])
        _damaged(where, f"section {offsets_name!r} cuts a character in two", at[offsets_name] + 8 * j)
    return offsets


def _damaged(where: str, what: str, offset: int) -> NoReturn:
    raise ManifestError(
        f"{where} {what} (remove it to read manifest.json alone; saving the manifest writes it again)",
        offset=offset,
    )
