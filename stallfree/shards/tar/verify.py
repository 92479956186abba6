"""Verify one tar shard: a sequential pass that hashes it, walks its headers with the one tar
walker (truncation, corrupt headers, duplicate keys), compares them with its index and the
manifest's count and, where the manifest records them, checks each member against its ``.sums``
entry (so a damaged sample is named by shard, key, field and offset)."""

from __future__ import annotations

import posixpath
from array import array
from collections.abc import Iterable, Iterator

import fsspec

from stallfree.errors import (
    CorruptShardError,
    DuplicateKeyError,
    IndexMismatchError,
    MissingShardError,
    ShardError,
)
from stallfree.shards.fields import is_image_field
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.scan import SHARD_MISSING, record_mismatches
from stallfree.shards.tar.idx import IdxSample, idx_path_for, parse_idx
from stallfree.shards.tar.sums import checksum, mismatch, parse_sums, sums_path_for
from stallfree.shards.tar.walk import TarMember, group_samples, sample_parts, walk_tar
from stallfree.shards.tar.writer import BLOCK
from stallfree.shards.verify import HashingReader, add_capped, decode_image
from stallfree.shards.verify_report import KeyAt, ProgressFn, VerifyReport
from stallfree.storage import remote
from stallfree.storage.fs import file_size, open_read


def _inspecting(
    members: Iterable[TarMember],
    reader: HashingReader,
    shard: str,
    report: VerifyReport,
    found: list[ShardError],
    damaged: list[ShardError],
    *,
    decode: bool,
    sums: array | None,
    counted: list[int],
) -> Iterator[TarMember]:
    """Pass members on, checking each one's data on the way (read once, while the walker is still
    at it: the reader only goes forward): against its recorded checksum (``sums``, one per member
    in the order the writer wrote them, which is the tar's own: the ``.idx`` is not needed to
    match them), and, with ``decode``, that an image member decodes. ``counted[0]``: members seen."""
    for j, m in enumerate(members):
        counted[0] = j + 1
        parts = sample_parts(m.name)
        want = sums[j] if sums is not None and j < len(sums) else None
        image = decode and parts is not None and is_image_field(parts[1])
        if want is None and not image:
            yield m
            continue
        data = reader.read(m.offset, m.end)
        key, fieldname = parts if parts is not None else (m.name, "")
        if want is not None and len(data) == m.size:  # (a member cut short is the walker's to report)
            got = checksum(data)
            if got != want:
                damaged.append(mismatch(shard, key, fieldname, m.offset, got, want, m.size))
        if image:
            report.decoded += 1
            problem = decode_image(data, shard, key, m.offset, fieldname)
            if problem is not None:
                found.append(problem)
        yield m


def _load_sums(fs: fsspec.AbstractFileSystem, path: str, shard: str) -> tuple[array | None, list[ShardError]]:
    """The checksums in the ``.sums`` beside a tar; or None and the problem (missing, malformed)."""
    name = posixpath.basename(sums_path_for(path))
    try:
        return parse_sums(remote.read_file(fs, sums_path_for(path), shard=name), shard), []
    except MissingShardError:
        return None, [
            IndexMismatchError(
                f"missing checksums {name}: the manifest records them for every tar", shard=shard
            )
        ]
    except IndexMismatchError as exc:
        return None, [exc]


def _load_index(
    fs: fsspec.AbstractFileSystem, path: str, shard: str
) -> tuple[list[IdxSample] | None, list[ShardError]]:
    """The ``.idx`` beside a tar, parsed; or None and the problem (missing, malformed)."""
    idx_path = idx_path_for(path)
    name = posixpath.basename(idx_path)
    try:
        return parse_idx(remote.read_file(fs, idx_path, shard=name), shard=name), []
    except MissingShardError:
        return None, [IndexMismatchError(f"missing index {name}: no .idx file beside the shard", shard=shard)]
    except IndexMismatchError as exc:
        return None, [exc]


def _at_header(exc: CorruptShardError, entries: list[IdxSample] | None) -> CorruptShardError:
    """A bad header names the last good key (all the walker knows); when the index says which
    sample's header sits at that offset, name that sample instead."""
    if entries is None or exc.offset is None:
        return exc
    for e in entries:
        for _, off, _, _ in e.members:
            if off - BLOCK == exc.offset:
                if e.key == exc.key:
                    return exc
                return CorruptShardError(exc.reason, shard=exc.shard, key=e.key, offset=exc.offset)
    return exc


def verify_tar_shard(
    fs: fsspec.AbstractFileSystem,
    path: str,
    info: ShardInfo,
    report: VerifyReport,
    *,
    index: list[IdxSample] | None = None,
    hashes: bool = True,
    decode: bool = False,
    progress: ProgressFn | None = None,
    checksums: str | None = None,
) -> list[KeyAt]:
    """Check one tar shard, adding problems to ``report``; returns its samples' keys (with the
    offset of each one's first header) for the cross-shard duplicate check. ``index`` is the
    index the dataset reads the shard through; None: the ``.idx`` beside it. ``checksums``
    (the manifest's): check every member against the ``.sums`` beside the tar."""
    shard = info.path
    walk_errors: list[ShardError] = []
    duplicates: list[DuplicateKeyError] = []
    decoded: list[ShardError] = []
    damaged: list[ShardError] = []
    samples: list[IdxSample] = []
    sums, sums_errors = _load_sums(fs, path, shard) if checksums else (None, [])
    counted = [0]
    size = file_size(fs, path, shard=shard, missing=SHARD_MISSING)
    with open_read(fs, path, size, shard=shard, block_size=1 << 22) as f:  # checked reads
        reader = HashingReader(f, size, progress)
        members = walk_tar(reader, shard)
        if decode or sums is not None:
            members = _inspecting(
                members, reader, shard, report, decoded, damaged, decode=decode, sums=sums, counted=counted
            )
        try:
            samples.extend(group_samples(members, shard, on_duplicate=duplicates.append))
        except CorruptShardError as exc:
            walk_errors.append(exc)
        reader.read_rest()
    index_errors: list[ShardError] = []
    if index is None:
        index, index_errors = _load_index(fs, path, shard)
    errors = report.errors
    errors.extend(_at_header(e, index) for e in walk_errors)  # type: ignore[arg-type]
    report.bytes += reader.pos
    errors.extend(record_mismatches(info, reader.pos, reader.sha.hexdigest() if hashes else None))
    errors.extend(duplicates)
    report.samples += len(samples)
    truncated = bool(walk_errors)  # past a corrupt spot every comparison would differ: noise
    if not truncated and len(samples) != info.samples:
        errors.append(
            IndexMismatchError(
                f"manifest says {info.samples} samples, the tar holds {len(samples)}", shard=shard
            )
        )
    errors.extend(index_errors)
    if index is not None and not truncated:
        _compare_index(index, samples, info, shard, report)
    errors.extend(sums_errors)
    if sums is not None and not truncated and counted[0] != len(sums):
        damaged.clear()  # checksums of another tar (or none of this one's): comparing them says nothing
        errors.append(
            IndexMismatchError(
                f"{posixpath.basename(sums_path_for(path))} holds {len(sums)} checksums, the tar has "
                f"{counted[0]} members",
                shard=shard,
            )
        )
    add_capped(report, damaged, "damaged members", shard)
    errors.extend(decoded)
    return [(s.key, s.members[0][1] - BLOCK) for s in samples]


def _compare_index(
    entries: list[IdxSample], samples: list[IdxSample], info: ShardInfo, shard: str, report: VerifyReport
) -> None:
    if len(entries) != info.samples:
        report.errors.append(
            IndexMismatchError(
                f".idx lists {len(entries)} samples, manifest says {info.samples}", shard=shard
            )
        )
    actual = {(name, off, size) for s in samples for _, off, size, name in s.members}
    listed = [(e.key, name, off, size) for e in entries for _, off, size, name in e.members]
    bad = [
        IndexMismatchError(
            f".idx entry {name} ({size} bytes) does not match the tar headers",
            shard=shard,
            key=key,
            offset=off,
        )
        for key, name, off, size in listed
        if (name, off, size) not in actual
    ]
    add_capped(report, bad, ".idx mismatches", shard)
    listed_names = {name for _, name, _, _ in listed}
    missing = [
        IndexMismatchError(f"member {name} is not in the .idx", shard=shard, key=s.key, offset=off)
        for s in samples
        for _, off, _, name in s.members
        if name not in listed_names
    ]
    add_capped(report, missing, "members missing from the .idx", shard)
