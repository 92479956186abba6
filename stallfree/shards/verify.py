"""``stallfree verify`` and ``ShardedDataset.verify``: the one verifier. It checks a dataset
against its manifest and reports every problem found.

Each shard is checked by its format (``formats.py``: ``Format.verify``, the two functions here).
One sequential pass per shard checks size and sha256 and, for tar shards, walks the headers with
the one tar walker (``tar_walk``: truncation, corrupt headers, duplicate keys) to compare against
the index (the ``.idx``, or the one a dataset without a manifest built) and the manifest's sample
count; Arrow shards are opened, validated and counted. Every shard's keys are checked against the
shards before it, so a key two shards share is found too (the dataset would yield it twice; a
cache or a resume keyed by it would confuse the two). Where the manifest records per-member
checksums (``checksums: crc32``, a ``.sums`` beside each tar: ``sums.py``), each member's data is
checked against its own as the pass goes by, so a damaged sample is named (shard, key, field, data
offset) where the shard's sha256 could only say the shard differs. ``decode=True`` also decodes
image fields with PIL. Problems are collected (not raised) so one run lists them all, each naming
the shard, the sample key and the byte offset where known.
"""

from __future__ import annotations

import hashlib
import io
import logging
import posixpath
from array import array
from collections.abc import Iterable, Iterator
from typing import IO, Any

import fsspec

from stallfree.errors import (
    CorruptShardError,
    DuplicateKeyError,
    IndexMismatchError,
    MissingShardError,
    SampleDecodeError,
    ShardError,
    ShardReadError,
)
from stallfree.shards import formats
from stallfree.shards.fields import is_image_field
from stallfree.shards.manifest.model import MANIFEST_NAME, Manifest, ShardInfo, join
from stallfree.shards.readers import check_stream_schema, unreadable_table
from stallfree.shards.scan import file_size, record_mismatches
from stallfree.shards.tar.idx import IdxSample, idx_path_for, parse_idx
from stallfree.shards.tar.sums import checksum, mismatch, parse_sums, sums_path_for
from stallfree.shards.tar.walk import TarMember, group_samples, sample_parts, walk_tar
from stallfree.shards.tar.writer import BLOCK
from stallfree.shards.verify_report import KeyAt, Problem, ProgressFn, VerifyReport
from stallfree.storage import remote

log = logging.getLogger(__name__)

MAX_LISTED = 10  # problems of one kind listed per shard before a "... and N more" line


class _HashingReader:
    """The walker's ``ByteReader`` over a file read once, front to back: every byte read or
    skipped is hashed and counted, so one pass checks headers, sha256 and size together."""

    def __init__(self, f: IO[bytes], size: int, progress: ProgressFn | None) -> None:
        self.f = f
        self.size = size
        self.sha = hashlib.sha256()
        self.pos = 0
        self.progress = progress

    def _next(self, n: int) -> bytes:
        parts = []
        while n > 0:
            data = self.f.read(min(n, 1 << 22))
            if not data:
                break
            self.sha.update(data)
            self.pos += len(data)
            if self.progress is not None:
                self.progress(len(data))
            parts.append(data)
            n -= len(data)
        return b"".join(parts)

    def read(self, start: int, end: int, ahead: bool = False) -> bytes:
        if start < self.pos:
            raise ValueError(f"sequential read of bytes {start}..{end} after byte {self.pos}")
        while self.pos < start and self._next(min(start - self.pos, 1 << 22)):
            pass
        return self._next(end - start)

    def read_rest(self) -> None:
        while self._next(1 << 22):
            pass


def _decode_image(data: bytes, shard: str, key: str, offset: int | None, fieldname: str) -> ShardError | None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
        return SampleDecodeError(
            f"field {fieldname!r} does not decode as an image: {exc}", shard=shard, key=key, offset=offset
        )
    return None


def _inspecting(
    members: Iterable[TarMember],
    reader: _HashingReader,
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
            problem = _decode_image(data, shard, key, m.offset, fieldname)
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
    size = file_size(fs, path, shard)
    with remote.open_read(fs, path, size, shard=shard, block_size=1 << 22) as f:  # checked reads
        reader = _HashingReader(f, size, progress)
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
    _add_capped(report, damaged, "damaged members", shard)
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
    _add_capped(report, bad, ".idx mismatches", shard)
    listed_names = {name for _, name, _, _ in listed}
    missing = [
        IndexMismatchError(f"member {name} is not in the .idx", shard=shard, key=s.key, offset=off)
        for s in samples
        for _, off, _, name in s.members
        if name not in listed_names
    ]
    _add_capped(report, missing, "members missing from the .idx", shard)


def _add_capped(report: VerifyReport, errors: list[ShardError], what: str, shard: str) -> None:
    """The first ``MAX_LISTED`` errors of one kind, then one line counting the rest."""
    report.errors.extend(errors[:MAX_LISTED])
    if len(errors) > MAX_LISTED:
        report.errors.append(type(errors[0])(f"... and {len(errors) - MAX_LISTED} more {what}", shard=shard))


def _table_batches(f: IO[bytes], path: str, shard: str) -> tuple[Iterator[Any], str]:
    """The record batches of a table shard, front to back, in whichever layout ``open_dataset``
    reads (``readers.open_batches``): Arrow IPC file (ours), Arrow IPC *stream* (Hugging Face
    ``save_to_disk`` and ``datasets``' cache files, no footer), Parquet (``.parquet``). Returns
    them with the layout's name for messages; CorruptShardError naming the shard if it is none.
    Streamed front to back here (the readers' ``open_batches`` keeps a stream's batches for
    random access); the checks and messages are the readers' own."""
    import pyarrow as pa

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(f).iter_batches(), "Parquet file"
        except (pa.ArrowException, OSError) as exc:
            raise unreadable_table(path, shard, exc) from None
    try:
        reader = pa.ipc.open_file(f)
    except pa.ArrowInvalid as file_exc:
        f.seek(0)
        try:
            stream = pa.ipc.open_stream(f)
        except (pa.ArrowInvalid, OSError):
            raise unreadable_table(path, shard, file_exc) from None
        check_stream_schema(stream.schema, shard)  # what the reader refuses
        return iter(stream), "Arrow IPC stream"
    return (reader.get_batch(b) for b in range(reader.num_record_batches)), "Arrow IPC file"


def verify_arrow_shard(
    fs: fsspec.AbstractFileSystem,
    path: str,
    info: ShardInfo,
    report: VerifyReport,
    *,
    hashes: bool = True,
    decode: bool = False,
    progress: ProgressFn | None = None,
) -> list[KeyAt]:
    """Check one table shard (Arrow IPC file or stream, or Parquet: ``_table_batches``), adding
    problems to ``report``; returns its rows' keys (as the dataset yields them: ``stem/row`` where
    the file has no ``__key__`` column) for the cross-shard check."""
    import pyarrow as pa

    shard = info.path
    errors = report.errors
    size = file_size(fs, path, shard)
    with remote.open_read(fs, path, size, shard=shard, block_size=1 << 22) as f:  # checked reads
        reader = _HashingReader(f, 0, progress)
        reader.read_rest()
    report.bytes += reader.pos
    errors.extend(record_mismatches(info, reader.pos, reader.sha.hexdigest() if hashes else None))
    stem = posixpath.splitext(shard)[0]
    found: list[KeyAt] = []  # as the dataset yields them; rows with a null key have none
    layout = "Parquet file" if path.endswith(".parquet") else "Arrow IPC file"
    b = -1
    try:
        with remote.open_read(fs, path, size, shard=shard) as f:
            batches, layout = _table_batches(f, path, shard)
            rows = 0
            seen: set[str] = set()
            for b, batch in enumerate(batches):
                try:
                    batch.validate(full=True)
                except Exception as exc:  # noqa: BLE001 - pyarrow's validation errors vary by version
                    errors.append(CorruptShardError(f"record batch {b} is invalid: {exc}", shard=shard))
                    continue
                has_key = "__key__" in batch.schema.names
                keys = batch.column("__key__").to_pylist() if has_key else [None] * batch.num_rows
                for r, key in enumerate(keys):
                    if key is not None and key in seen:
                        errors.append(
                            DuplicateKeyError("duplicate sample key in shard", shard=shard, key=key)
                        )
                    seen.add(key)
                    if key is not None:
                        found.append((str(key), None))
                    elif not has_key:
                        found.append((f"{stem}/{rows + r}", None))
                    if decode:
                        for name in batch.schema.names:
                            if is_image_field(name):
                                value = batch.column(name)[r].as_py()
                                if isinstance(value, bytes):
                                    report.decoded += 1
                                    problem = _decode_image(value, shard, str(key), None, name)
                                    if problem:
                                        errors.append(problem)
                rows += batch.num_rows
    except CorruptShardError as exc:
        errors.append(exc)
        return found
    except (pa.ArrowException, OSError, ValueError) as exc:
        what = f"{layout} unreadable after record batch {b}" if b >= 0 else f"not a readable {layout}"
        errors.append(CorruptShardError(f"{what}: {exc}", shard=shard))
        return found
    report.samples += rows
    if rows != info.samples:
        errors.append(
            IndexMismatchError(
                f"manifest says {info.samples} samples, the Arrow file holds {rows}", shard=shard
            )
        )
    return found


class KeyOwners:
    """The shard each sample key was first seen in, to find keys that two shards share. Holds
    every key once (a dict entry, ~100 bytes plus the key: ~200 MB for 1.3M keys), which only
    verifying pays; opening a dataset does not check this."""

    def __init__(self) -> None:
        self._first: dict[str, int] = {}  # key -> position of its shard in the manifest
        self._names: list[str] = []

    def add(self, shard: str, keys: Iterable[KeyAt]) -> list[DuplicateKeyError]:
        """Record the next shard's keys; an error for each key an earlier shard already holds (a
        key repeated inside one shard is that shard's own problem, reported where it is read)."""
        me = len(self._names)
        self._names.append(shard)
        first, found = self._first, []
        for key, offset in keys:
            owner = first.setdefault(key, me)
            if owner != me:
                found.append((key, offset, self._names[owner]))
        errors = []
        for key, offset, owner in found[:MAX_LISTED]:
            twice = " (the manifest lists that file twice)" if owner == shard else ""
            errors.append(
                DuplicateKeyError(
                    f"duplicate sample key across shards: also in {owner}{twice}",
                    shard=shard,
                    key=key,
                    offset=offset,
                )
            )
        if len(found) > MAX_LISTED:
            owners = sorted({owner for _, _, owner in found[MAX_LISTED:]})
            where = ", ".join(owners[:5]) + (f" and {len(owners) - 5} more shards" if len(owners) > 5 else "")
            errors.append(
                DuplicateKeyError(
                    f"... and {len(found) - MAX_LISTED} more sample keys also in {where}", shard=shard
                )
            )
        return errors


def verify_manifest(
    fs: fsspec.AbstractFileSystem,
    root: str,
    manifest: Manifest,
    *,
    indices: list[list[IdxSample]] | None = None,
    hashes: bool = True,
    decode: bool = False,
    progress: ProgressFn | None = None,
    dataset: str | None = None,
) -> VerifyReport:
    """Check every shard ``manifest`` lists under ``root``. ``indices``: per tar shard, the index
    the dataset reads it through when it has no ``.idx`` of its own (``open_dataset`` without a
    manifest); ``hashes=False`` skips the sha256 comparison (every byte is still read)."""
    report = VerifyReport(dataset or root, format=manifest.format)
    fmt = formats.get_format(manifest.format, where=dataset or root)
    owners = KeyOwners()
    for s, info in enumerate(manifest.shards):
        shard_path = join(root, info.path)
        report.shards += 1
        try:
            if not fs.exists(shard_path):
                raise MissingShardError(f"shard file {shard_path} is missing", shard=info.path)
            check = formats.ShardCheck(
                fs,
                shard_path,
                info,
                index=indices[s] if indices is not None else None,
                hashes=hashes,
                decode=decode,
                progress=progress,
                checksums=manifest.checksums,
            )
            keys = fmt.verify(check, report)
            report.errors.extend(owners.add(info.path, keys))
        except ShardError as exc:
            report.errors.append(exc)
        except OSError as exc:
            report.errors.append(ShardReadError(f"cannot read {shard_path}: {exc}", shard=info.path))
    return report


def verify_dataset(
    url: str,
    *,
    decode: bool = False,
    hashes: bool = True,
    progress: ProgressFn | None = None,
    **storage_options: Any,
) -> VerifyReport:
    """Check every shard of the dataset at ``url`` (a directory or its ``manifest.json``) against
    its manifest. A manifest that is missing or unreadable is the report's one problem; a URL
    naming shard files rather than a dataset raises MissingShardError (there is nothing to
    verify them against)."""
    fs, path = remote.url_to_fs(url, **storage_options)  # with connect/read timeouts
    shard_suffixes = formats.scan_suffixes()
    if path.endswith(shard_suffixes) or "{" in url or any(c in path for c in "*?["):
        parent = posixpath.dirname(path)
        hint = (
            f"pass its dataset directory {fs.unstrip_protocol(parent)}"
            if path.endswith(shard_suffixes) and fs.exists(posixpath.join(parent, MANIFEST_NAME))
            else f"write a manifest for plain tars with `stallfree index {url}`"
        )
        raise MissingShardError(
            f"{url} names shard files, not a dataset: verify checks a dataset directory (or its "
            f"{MANIFEST_NAME}) against the manifest; {hint}",
            shard=posixpath.basename(path),
        )
    root = posixpath.dirname(path) if path.endswith(".json") else path.rstrip("/")
    try:
        manifest = Manifest.load(path, fs=fs)
    except MissingShardError as exc:
        exc.reason += (
            " (nothing to verify against; for plain WebDataset tars write one with `stallfree index`)"
        )
        return VerifyReport(url, errors=[exc])
    except ShardError as exc:
        return VerifyReport(url, errors=[exc])
    return verify_manifest(fs, root, manifest, hashes=hashes, decode=decode, progress=progress, dataset=url)


def total_bytes(url: str, **storage_options: Any) -> int | None:
    """The manifest's byte total (for a progress bar), or None if it cannot be read."""
    try:
        return Manifest.load(url, **storage_options).bytes
    except (ShardError, OSError):
        return None


__all__ = [
    "KeyAt",
    "KeyOwners",
    "Problem",
    "ProgressFn",
    "VerifyReport",
    "total_bytes",
    "verify_arrow_shard",
    "verify_dataset",
    "verify_manifest",
    "verify_tar_shard",
]
