"""The tar shard format (WebDataset layout): one shard is a ``.tar`` with a DALI ``.idx`` and a
``.sums`` (per-member CRC32) beside it. The parts live in their own modules (writer ``tar.py``,
reader ``tar.reader.TarShardReader``, verify ``tar.verify.verify_tar_shard``, indexing without a
manifest ``scan.manifest_for_tars``); this file is what the registry (``formats.py``) knows of
them."""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Any

import fsspec

from stallfree.errors import MissingShardError
from stallfree.shards.formats import ScannedFiles, ShardCheck, ShardOpen
from stallfree.shards.scan import manifest_for_tars
from stallfree.shards.tar.idx import IdxSample, idx_path_for
from stallfree.shards.tar.reader import TarShardReader
from stallfree.shards.tar.sums import ALGORITHM as SUMS_ALGORITHM
from stallfree.shards.tar.sums import MemberSums, parse_sums, sums_path_for
from stallfree.shards.tar.verify import verify_tar_shard
from stallfree.shards.tar.writer import BLOCK, PreparedSample, TarShardWriter, padded, prepare
from stallfree.shards.verify_report import KeyAt, VerifyReport
from stallfree.storage import remote
from stallfree.storage.atomic import OverlappedHashFile

TRAILER = 2 * BLOCK  # the end-of-archive blocks every tar ends with


class OverlappedTarWriter(TarShardWriter):
    """A ``TarShardWriter`` whose sha256 runs on a helper thread (same bytes, same digest)."""

    file_class = OverlappedHashFile


class TarFormat:
    """Tar shards: fields are bytes (a member per field), every shard has its ``.idx`` and its
    ``.sums``, and ``stallfree index`` writes a manifest for tars other tools wrote."""

    name = "tar"
    suffix = ".tar"
    scan_suffixes = (".tar",)
    shard_overhead = TRAILER
    checksums = SUMS_ALGORITHM
    typed_fields = False
    indexable = True

    def sidecars(self, path: str, with_checksums: bool = True) -> list[str]:
        return [idx_path_for(path)] + ([sums_path_for(path)] if with_checksums else [])

    def item_cost(self, sizes: Sequence[int]) -> int:
        """Exact when the sizes are: a header block per member, its data padded to whole blocks."""
        return sum(BLOCK + padded(s) for s in sizes)

    def prepare(self, sample: dict[str, Any]) -> PreparedSample:
        return prepare(sample)

    def writer(
        self, path: str, fs: fsspec.AbstractFileSystem, *, schema: Any = None, overlap_hash: bool = False
    ) -> TarShardWriter:
        return (OverlappedTarWriter if overlap_hash else TarShardWriter)(path, fs=fs)

    def source_schema(self, source: Any) -> None:
        return None

    def open_reader(self, request: ShardOpen) -> TarShardReader:
        info = request.info
        check = _member_sums(request.fs, request.path, info.path) if request.verify_samples else None
        return TarShardReader(
            request.fs, request.path, info.path, info, request.index, request.verify_hash, member_check=check
        )

    def key_in_index(self, index: list[IdxSample], row: int) -> str:
        """Row ``row``'s key from a scanned index (``ScannedFiles.indices``), with no request."""
        return index[row].key

    def verify(self, check: ShardCheck, report: VerifyReport) -> list[KeyAt]:
        return verify_tar_shard(
            check.fs,
            check.path,
            check.info,
            report,
            index=check.index,
            hashes=check.hashes,
            decode=check.decode,
            progress=check.progress,
            checksums=check.checksums,
        )

    def scan(self, fs: fsspec.AbstractFileSystem, root: str, paths: list[str]) -> ScannedFiles:
        manifest, indices = manifest_for_tars(fs, root, paths, stamp_shards=True)
        return ScannedFiles(list(manifest.shards), list(manifest.fields), indices)


def _member_sums(fs: fsspec.AbstractFileSystem, path: str, shard: str) -> MemberSums:
    """Shard ``path``'s recorded checksums (its ``.sums``; read once, when the shard opens)."""
    sums = sums_path_for(path)
    try:
        data = remote.read_file(fs, sums, shard=shard)
    except MissingShardError:
        raise MissingShardError(
            f"missing checksums {posixpath.basename(sums)} (the manifest records them for every tar)",
            shard=shard,
        ) from None
    return MemberSums(parse_sums(data, shard), shard)


TAR = TarFormat()

__all__ = ["TAR", "OverlappedTarWriter", "TarFormat"]
