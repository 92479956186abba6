"""``stallfree verify`` and ``ShardedDataset.verify``: the one verifier. It checks a dataset
against its manifest and reports every problem found.

Each shard is checked by its format (``formats.py``: ``Format.verify``: ``tar/verify.py``,
``arrow/verify.py``); the parts they share are here.
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
import posixpath
from collections.abc import Iterable, Sequence
from typing import IO, Any

import fsspec

from stallfree.errors import (
    DuplicateKeyError,
    MissingShardError,
    SampleDecodeError,
    ShardError,
    ShardReadError,
)
from stallfree.shards import formats
from stallfree.shards.manifest.model import MANIFEST_NAME, Manifest, join
from stallfree.shards.verify_report import KeyAt, Problem, ProgressFn, VerifyReport
from stallfree.storage import remote

MAX_LISTED = 10  # problems of one kind listed per shard before a "... and N more" line


class HashingReader:
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


def decode_image(data: bytes, shard: str, key: str, offset: int | None, fieldname: str) -> ShardError | None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
        return SampleDecodeError(
            f"field {fieldname!r} does not decode as an image: {exc}", shard=shard, key=key, offset=offset
        )
    return None


def add_capped(report: VerifyReport, errors: list[ShardError], what: str, shard: str) -> None:
    """The first ``MAX_LISTED`` errors of one kind, then one line counting the rest."""
    report.errors.extend(errors[:MAX_LISTED])
    if len(errors) > MAX_LISTED:
        report.errors.append(type(errors[0])(f"... and {len(errors) - MAX_LISTED} more {what}", shard=shard))


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
    indices: Sequence[Any] | None = None,
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
    "verify_dataset",
    "verify_manifest",
]
