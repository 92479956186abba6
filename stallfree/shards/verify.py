"""``stallfree verify``: check a dataset against its manifest and report every problem found.

One sequential pass per shard checks size and sha256 and, for tar shards, walks the headers
(truncation, corrupt headers, duplicate keys) to compare against the ``.idx`` and the manifest's
sample count; Arrow shards are opened and counted. Every shard's keys are checked against the
shards before it, so a key two shards share is found too (the dataset would yield it twice; a
cache or a resume keyed by it would confuse the two). ``decode=True`` also decodes image fields
with PIL. Problems are collected (not raised) so one run lists them all, each naming the shard, the
sample key and the byte offset where known.
"""

from __future__ import annotations

import hashlib
import io
import logging
import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec

from stallfree.shards.errors import (
    CorruptShardError,
    DuplicateKeyError,
    HashMismatchError,
    IndexMismatchError,
    MissingShardError,
    SampleDecodeError,
    ShardError,
)
from stallfree.shards.manifest import Manifest, ShardInfo, join
from stallfree.shards.scan import pax_path

log = logging.getLogger(__name__)

BLOCK = 512
IMAGE_FIELDS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "ppm", "pgm", "tif", "tiff"}
ProgressFn = Callable[[int], None]  # bytes checked
KeyAt = tuple[str, int | None]  # a sample key and the byte offset of its first header (tar)
MAX_LISTED = 10  # problems of one kind listed per shard before a "... and N more" line


@dataclass
class Problem:
    """One thing wrong: the error class name, where, and a message."""

    error: str
    message: str
    shard: str | None = None
    key: str | None = None
    offset: int | None = None

    @classmethod
    def from_error(cls, exc: ShardError) -> Problem:
        return cls(type(exc).__name__, exc.reason, exc.shard, exc.key, exc.offset)

    def to_json(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "shard": self.shard,
            "key": self.key,
            "offset": self.offset,
            "message": self.message,
        }


@dataclass
class VerifyReport:
    dataset: str
    format: str | None = None
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    decoded: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "ok": self.ok,
            "format": self.format,
            "shards": self.shards,
            "samples": self.samples,
            "bytes": self.bytes,
            "decoded": self.decoded,
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass
class Member:
    name: str
    offset: int  # of the data
    size: int


class _HashingReader:
    """Reads a file sequentially, hashing and counting every byte read."""

    def __init__(self, f: IO[bytes], progress: ProgressFn | None) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.pos = 0
        self.progress = progress

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        self.sha.update(data)
        self.pos += len(data)
        if self.progress is not None and data:
            self.progress(len(data))
        return data

    def read_rest(self) -> None:
        while self.read(1 << 22):
            pass

    def skip(self, n: int) -> int:
        """Read (and hash) ``n`` bytes without keeping them; returns how many there were."""
        got = 0
        while got < n:
            chunk = self.read(min(1 << 22, n - got))
            if not chunk:
                break
            got += len(chunk)
        return got


def walk_tar(
    reader: _HashingReader, shard: str, *, keep: Callable[[str], bool] | None = None
) -> tuple[list[Member], dict[str, bytes], list[Problem]]:
    """Walk a tar's headers sequentially: regular members (name, data offset, size), the data of
    members for which ``keep(name)`` is true, and problems (corrupt or truncated). Stops at the
    end-of-archive blocks or at the first corrupt/truncated spot (nothing after it can be trusted)."""
    from stallfree.shards.tar import parse_header, split_name

    members: list[Member] = []
    kept: dict[str, bytes] = {}
    problems: list[Problem] = []
    long_name: str | None = None
    last_key: str | None = None
    while True:
        offset = reader.pos
        block = reader.read(BLOCK)
        if not block:
            problems.append(
                Problem.from_error(
                    CorruptShardError(
                        "truncated tar: no end-of-archive blocks", shard=shard, key=last_key, offset=offset
                    )
                )
            )
            break
        if block == bytes(BLOCK):
            break  # end of archive
        try:
            name, size, typeflag = parse_header(block, offset, shard, last_key)
        except CorruptShardError as exc:
            problems.append(Problem.from_error(exc))
            break
        data_offset = reader.pos
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        if typeflag in (b"x", b"L"):
            data = reader.read(padded)
            if len(data) < padded:
                problems.append(
                    Problem.from_error(
                        CorruptShardError(
                            "truncated tar: extended header cut short",
                            shard=shard,
                            key=last_key,
                            offset=data_offset,
                        )
                    )
                )
                break
            long_name = (
                pax_path(data[:size])
                if typeflag == b"x"
                else data[:size].rstrip(b"\0").decode("utf-8", "surrogateescape")
            )
            continue
        if typeflag == b"g":
            reader.skip(padded)
            continue
        if long_name is not None:
            name, long_name = long_name, None
        if typeflag in (b"0", b"\0", b"7"):
            key = split_name(name)[0]
            if keep is not None and keep(name):
                data = reader.read(padded)
                got = len(data)
                kept[name] = data[:size]
            else:
                got = reader.skip(padded)
            if got < padded:
                problems.append(
                    Problem.from_error(
                        CorruptShardError(
                            f"truncated tar: member {name} needs {size} bytes, only {min(got, size)} present",
                            shard=shard,
                            key=key,
                            offset=data_offset,
                        )
                    )
                )
                break
            members.append(Member(name, data_offset, size))
            last_key = key
        else:
            reader.skip(padded)
    reader.read_rest()
    return members, kept, problems


def group_samples(members: list[Member], shard: str) -> tuple[list[tuple[str, list[Member]]], list[Problem]]:
    """Group contiguous members by key (WebDataset's rule); a key seen again later is a duplicate."""
    from stallfree.shards.tar import split_name

    samples: list[tuple[str, list[Member]]] = []
    seen: set[str] = set()
    problems: list[Problem] = []
    for m in members:
        key = split_name(m.name)[0]
        if samples and samples[-1][0] == key:
            samples[-1][1].append(m)
            continue
        if key in seen:
            problems.append(
                Problem.from_error(
                    DuplicateKeyError(
                        "duplicate sample key in shard", shard=shard, key=key, offset=m.offset - BLOCK
                    )
                )
            )
        seen.add(key)
        samples.append((key, [m]))
    return samples, problems


def _decode_image(data: bytes, shard: str, key: str, offset: int | None, fieldname: str) -> Problem | None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
        return Problem.from_error(
            SampleDecodeError(
                f"field {fieldname!r} does not decode as an image: {exc}", shard=shard, key=key, offset=offset
            )
        )
    return None


def _is_image_member(name: str) -> bool:
    from stallfree.shards.tar import split_name

    return split_name(name)[1].rsplit(".", 1)[-1].lower() in IMAGE_FIELDS


def verify_tar_shard(
    fs: fsspec.AbstractFileSystem,
    path: str,
    info: ShardInfo,
    report: VerifyReport,
    *,
    decode: bool,
    progress: ProgressFn | None,
) -> list[KeyAt]:
    """Check one tar shard, adding problems to ``report``; returns its samples' keys (with the
    offset of each one's first header) for the cross-shard duplicate check."""
    from stallfree.shards.idx import idx_path_for, parse_idx

    shard = info.path
    with fs.open(path, "rb", block_size=1 << 22) as f:
        reader = _HashingReader(f, progress)
        members, kept, problems = walk_tar(reader, shard, keep=_is_image_member if decode else None)
    report.problems.extend(problems)
    _check_size_and_hash(reader, info, report)
    samples, dup = group_samples(members, shard)
    report.problems.extend(dup)
    report.samples += len(samples)
    truncated = any(p.error == "CorruptShardError" for p in problems)
    if not truncated and len(samples) != info.samples:
        report.problems.append(
            Problem.from_error(
                IndexMismatchError(
                    f"manifest says {info.samples} samples, the tar holds {len(samples)}", shard=shard
                )
            )
        )
    idx_path = idx_path_for(path)
    try:
        entries = parse_idx(fs.cat_file(idx_path), shard=posixpath.basename(idx_path))
    except FileNotFoundError:
        report.problems.append(
            Problem.from_error(
                IndexMismatchError(f"missing index {posixpath.basename(idx_path)}", shard=shard)
            )
        )
        entries = None
    except IndexMismatchError as exc:
        report.problems.append(Problem.from_error(exc))
        entries = None
    if entries is not None and not truncated:  # past a corrupt spot every entry would differ: noise
        _compare_idx(entries, samples, info, shard, report)
    if decode:
        for key, ms in samples:
            for m in ms:
                if m.name in kept:
                    report.decoded += 1
                    problem = _decode_image(kept[m.name], shard, key, m.offset, m.name[len(key) + 1 :])
                    if problem:
                        report.problems.append(problem)
    return [(key, ms[0].offset - BLOCK) for key, ms in samples]


def _compare_idx(
    entries: list, samples: list[tuple[str, list[Member]]], info: ShardInfo, shard: str, report: VerifyReport
) -> None:
    if len(entries) != info.samples:
        report.problems.append(
            Problem.from_error(
                IndexMismatchError(
                    f".idx lists {len(entries)} samples, manifest says {info.samples}", shard=shard
                )
            )
        )
    actual = {(m.name, m.offset, m.size) for _, ms in samples for m in ms}
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
        IndexMismatchError(f"member {m.name} is not in the .idx", shard=shard, key=key, offset=m.offset)
        for key, ms in samples
        for m in ms
        if m.name not in listed_names
    ]
    _add_capped(report, missing, "members missing from the .idx", shard)


def _add_capped(report: VerifyReport, errors: list[ShardError], what: str, shard: str) -> None:
    """The first ``MAX_LISTED`` errors of one kind, then one line counting the rest."""
    report.problems.extend(Problem.from_error(e) for e in errors[:MAX_LISTED])
    if len(errors) > MAX_LISTED:
        report.problems.append(
            Problem(type(errors[0]).__name__, f"... and {len(errors) - MAX_LISTED} more {what}", shard)
        )


def _check_size_and_hash(reader: _HashingReader, info: ShardInfo, report: VerifyReport) -> None:
    report.bytes += reader.pos
    if reader.pos != info.bytes:
        report.problems.append(
            Problem.from_error(
                CorruptShardError(
                    f"size {reader.pos} bytes, manifest says {info.bytes}", shard=info.path, offset=reader.pos
                )
            )
        )
    if info.sha256 is not None and reader.sha.hexdigest() != info.sha256:
        report.problems.append(
            Problem.from_error(
                HashMismatchError(
                    f"sha256 {reader.sha.hexdigest()[:16]}... != manifest {info.sha256[:16]}...",
                    shard=info.path,
                )
            )
        )


def verify_arrow_shard(
    fs: fsspec.AbstractFileSystem,
    path: str,
    info: ShardInfo,
    report: VerifyReport,
    *,
    decode: bool,
    progress: ProgressFn | None,
) -> list[KeyAt]:
    """Check one Arrow shard, adding problems to ``report``; returns its rows' keys (as the dataset
    yields them: ``stem/row`` where the file has no ``__key__`` column) for the cross-shard check."""
    import pyarrow as pa

    shard = info.path
    with fs.open(path, "rb", block_size=1 << 22) as f:
        reader = _HashingReader(f, progress)
        reader.read_rest()
    _check_size_and_hash(reader, info, report)
    stem = posixpath.splitext(shard)[0]
    found: list[KeyAt] = []  # as the dataset yields them; rows with a null key have none
    try:
        with fs.open(path, "rb") as f:
            ipc = pa.ipc.open_file(f)
            rows = 0
            seen: set[str] = set()
            for b in range(ipc.num_record_batches):
                batch = ipc.get_batch(b)
                has_key = "__key__" in batch.schema.names
                keys = batch.column("__key__").to_pylist() if has_key else [None] * batch.num_rows
                for r, key in enumerate(keys):
                    if key is not None and key in seen:
                        report.problems.append(
                            Problem.from_error(
                                DuplicateKeyError("duplicate sample key in shard", shard=shard, key=key)
                            )
                        )
                    seen.add(key)
                    if key is not None:
                        found.append((str(key), None))
                    elif not has_key:
                        found.append((f"{stem}/{rows + r}", None))
                    if decode:
                        for name in batch.schema.names:
                            if name.rsplit(".", 1)[-1].lower() in IMAGE_FIELDS:
                                value = batch.column(name)[r].as_py()
                                if isinstance(value, bytes):
                                    report.decoded += 1
                                    problem = _decode_image(value, shard, str(key), None, name)
                                    if problem:
                                        report.problems.append(problem)
                rows += batch.num_rows
    except (pa.ArrowException, OSError, ValueError) as exc:
        report.problems.append(
            Problem.from_error(CorruptShardError(f"not a readable Arrow IPC file: {exc}", shard=shard))
        )
        return found
    report.samples += rows
    if rows != info.samples:
        report.problems.append(
            Problem.from_error(
                IndexMismatchError(
                    f"manifest says {info.samples} samples, the Arrow file holds {rows}", shard=shard
                )
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


def verify_dataset(
    url: str, *, decode: bool = False, progress: ProgressFn | None = None, **storage_options: Any
) -> VerifyReport:
    """Check every shard of the dataset at ``url`` (a directory or its ``manifest.json``)."""
    report = VerifyReport(url)
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    root = posixpath.dirname(path) if path.endswith(".json") else path.rstrip("/")
    try:
        manifest = Manifest.load(path, fs=fs)
    except MissingShardError as exc:
        exc.reason += (
            " (nothing to verify against; for plain WebDataset tars write one with `stallfree index`)"
        )
        report.problems.append(Problem.from_error(exc))
        return report
    except ShardError as exc:
        report.problems.append(Problem.from_error(exc))
        return report
    report.format = manifest.format
    check = verify_tar_shard if manifest.format == "tar" else verify_arrow_shard
    owners = KeyOwners()
    for info in manifest.shards:
        shard_path = join(root, info.path)
        report.shards += 1
        try:
            if not fs.exists(shard_path):
                raise MissingShardError(f"shard file {shard_path} is missing", shard=info.path)
            keys = check(fs, shard_path, info, report, decode=decode, progress=progress)
            report.problems.extend(Problem.from_error(e) for e in owners.add(info.path, keys))
        except ShardError as exc:
            report.problems.append(Problem.from_error(exc))
        except OSError as exc:
            report.problems.append(Problem("OSError", f"cannot read {shard_path}: {exc}", info.path))
    return report


def total_bytes(url: str, **storage_options: Any) -> int | None:
    """The manifest's byte total (for a progress bar), or None if it cannot be read."""
    try:
        return Manifest.load(url, **storage_options).bytes
    except ShardError:
        return None
