"""What a store says identifies a file's content, for datasets that come without a manifest.

A dataset's fingerprint keys every cache entry (``Manifest.fingerprint``). With a manifest it is
the manifest (sha256 per shard where written by ``stallfree shard``). Tars opened without one were
fingerprinted from path, sample count and size alone: relabel every sample in place (same sizes)
and a node cache on disk went on delivering all 200 samples with the old labels. So an on-the-fly
index records, per shard, a *stamp*: what the store offers that changes when the file does, plus a
hash of the index the dataset reads it through (the ``.idx`` bytes, or the scanned headers).

What each store gives (``store_version``):

- local files: ``size``, ``mtime_ns``, ``ctime_ns`` (set by the kernel on every write, chmod or
  rename; a tool cannot set it back as it can mtime) and the inode (a file replaced by rename, as
  ``rsync`` does, is a new inode even with the old mtime). A copy of the dataset on another node
  has other stamps, so nodes then share no cluster cache entries: write a manifest to share them.
- S3 (s3fs): ``ETag`` (and ``VersionId`` on versioned buckets) and ``LastModified``.
- Google Cloud Storage (gcsfs): ``generation``, ``etag``, ``md5Hash``/``crc32c``.
- Azure (adlfs): ``etag``, ``last_modified``.
- HTTP(S): ``ETag``, ``Last-Modified``, ``Content-MD5`` or ``Digest``, where the server sends them.
- anything else: any of ``mtime``/``created`` fsspec reports; with none, only the size and the
  index hash, and a warning says that a shard rewritten in place with equal sizes keeps its
  fingerprint.

The same facts pin a remote shard's reads to the version that was opened (``open_version``,
``remote.VersionPin``): S3's ``VersionId`` or ``ETag``, HTTP's strong ``ETag`` or
``Last-Modified``; each ranged read then asks for that version, and a rewrite mid-run is
``remote.ObjectChangedError``, not new bytes (issue 36: 20 samples of a shard rewritten in place
with the same size were delivered with the new content). Where the store offers neither (a plain
HTTP server, other fsspec backends) a tar reader checks every member against its ``.sums``
instead (``sums.remote_member_check``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from stallfree.errors import MissingShardError
from stallfree.storage import remote
from stallfree.storage.fs import file_size, is_local

log = logging.getLogger(__name__)

# keys of ``fs.info`` that change with the content, in every backend's own spelling
_VERSION_KEYS = (
    "ETag",
    "etag",
    "e_tag",
    "VersionId",
    "version_id",
    "generation",
    "md5Hash",
    "crc32c",
    "Content-MD5",
    "Digest",
    "LastModified",
    "Last-Modified",
    "last_modified",
    "updated",
    "mtime",
    "created",
)


def store_version(fs: fsspec.AbstractFileSystem, path: str, shard: str) -> tuple[int, str | None]:
    """``(size, version)`` of a file from one stat (local) or one ``info`` request (remote);
    version is None when the store offers nothing beyond the size. MissingShardError if absent."""
    if is_local(fs):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise MissingShardError("shard not found", shard=shard) from None
        return st.st_size, f"mtime_ns={st.st_mtime_ns},ctime_ns={st.st_ctime_ns},ino={st.st_ino}"
    info = remote.lookup(fs, path, shard=shard)
    if info is None:
        raise MissingShardError("shard not found", shard=shard)
    size = info.get("size")
    if size is None:
        size = file_size(fs, path, shard=shard)  # raises the store's own explanation
    return int(size), version_of(info)


@dataclass(frozen=True, slots=True)
class OpenedObject:
    """A remote file as it was when opened: its size, and the version its reads are pinned to
    (None where the store offers none that a read can ask for)."""

    size: int
    pin: remote.VersionPin | None


def open_version(fs: fsspec.AbstractFileSystem, path: str, shard: str) -> OpenedObject:
    """Size and version of a remote file from one ``info`` request (what a reader asks anyway
    for the size). MissingShardError if absent, RemoteReadError if the store cannot be asked."""
    info = remote.lookup(fs, path, shard=shard)
    if info is None:
        raise MissingShardError("shard not found", shard=shard)
    size = info.get("size")
    if size is None:
        size = file_size(fs, path, shard=shard)  # raises the store's own explanation
    return OpenedObject(int(size), pin_for(fs, info))


def pin_for(fs: fsspec.AbstractFileSystem, info: dict[str, Any]) -> remote.VersionPin | None:
    """The version reads of the file ``info`` describes can be pinned to, or None: S3 (s3fs)
    ``VersionId`` (a versioned bucket; "null" is no version) else its ``ETag``; HTTP a strong
    ``ETag`` (a weak one, ``W/"..."``, never matches ``If-Match``) else ``Last-Modified``."""
    route = remote.pin_route(fs)
    etag = info.get("ETag") or info.get("etag")
    etag = str(etag) if etag else None
    if route == "s3":
        version = info.get("VersionId")
        if version and version != "null":
            return remote.VersionPin(etag=etag, version_id=str(version))
        return remote.VersionPin(etag=etag) if etag else None
    if route == "http":
        if etag and not etag.startswith("W/"):
            return remote.VersionPin(etag=etag)
        modified = info.get("Last-Modified")
        return remote.VersionPin(last_modified=str(modified)) if modified else None
    return None


def version_of(info: dict[str, Any]) -> str | None:
    """The content-version fields of an fsspec ``info`` dict, as one stable string (or None)."""
    parts = [f"{k}={info[k]}" for k in _VERSION_KEYS if info.get(k) not in (None, "")]
    return ",".join(parts) or None


def stamp(size: int, version: str | None, index: bytes | str) -> str:
    """A shard's stamp: size, the store's version (if any), and the sha256 of its index."""
    if isinstance(index, str):
        index = index.encode("utf-8", "surrogateescape")
    digest = hashlib.sha256(index).hexdigest()[:16]
    return f"size={size};{version or 'unversioned'};idx={digest}"


def warn_unversioned(dataset: str, shards: Sequence[str]) -> None:
    """One warning for the shards whose store gave no version (their stamp is size and index)."""
    if not shards:
        return
    names = ", ".join(shards[:3]) + (f" and {len(shards) - 3} more" if len(shards) > 3 else "")
    log.warning(
        "%s: the store reports no version (ETag, mtime) for %s: the dataset's fingerprint covers "
        "their paths, sizes and indexes only, so a shard rewritten in place with the same size keeps "
        "it and a persistent cache may serve its old samples. Write a manifest (`stallfree index`, "
        "which records each shard's sha256) to key caches by content.",
        dataset,
        names,
    )
