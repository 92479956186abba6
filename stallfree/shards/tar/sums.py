"""Per-member checksums of a tar shard, in a sidecar beside its ``.idx``: ``shard-000000.sums``.

A shard's sha256 says *that* it is damaged, not where: ``verify`` on a shard with 64 zeroed bytes
said ``HashMismatchError`` for the whole shard, and ``--decode`` passed (the bytes were not in an
image, or PIL decoded past them). The writer computes one CRC32 per member in the pass that writes
it (``tar.TarShardWriter``), so ``verify`` names the sample, field and byte offset, and
``open_dataset(..., verify_samples=True)`` checks every member it reads.

Why a sidecar: the tar and the ``.idx`` stay exactly what WebDataset and DALI read, and the
manifest stays small (a JSON list of 1.3M numbers per field would not be). Why CRC32 (``zlib``):
always available, and fast enough for a check users opt into: 16-24 us per 100 KB member here
(~4 GB/s); ``crc32c`` and xxHash's ``xxh3`` were 2-3x faster on members out of cache (4-12x in
cache) but are not dependencies (``benchmarks/bench_integrity.py`` measures those installed; the
header's algorithm byte leaves room for one). It catches every burst error up to 32 bits and all but 2^-32 of
the rest: damage, not tampering (a signed manifest would be the answer to that).

Remote reads of a shard whose store cannot pin a version (``stamps.pin_for``: a plain HTTP
server without ``ETag`` or ``Last-Modified``, fsspec backends other than S3 and HTTP) are checked
against it by default (``remote_member_check``): there, nothing else would notice a shard
rewritten in place with the same size mid-run. ``benchmarks/bench_remote_pin.py`` measures it.

Layout (little-endian)::

    magic b"SFsm" | version u8 (1) | algorithm u8 (1: zlib CRC32) | reserved u16 | count u64
    count x u32: one per member, in the ``.idx``'s order (row by row, members in order)
"""

from __future__ import annotations

import logging
import posixpath
import struct
import sys
import zlib
from array import array

import fsspec

from stallfree.errors import ChecksumMismatchError, IndexMismatchError, MissingShardError
from stallfree.storage import remote

log = logging.getLogger(__name__)

MAGIC = b"SFsm"
VERSION = 1
ALGORITHM = "crc32"  # what a manifest's ``checksums`` says
_ALGORITHM_IDS = {ALGORITHM: 1}
_HEADER = struct.Struct("<4sBBHQ")

checksum = zlib.crc32  # of one member's data


def sums_path_for(tar_path: str) -> str:
    """``dir/shard-000001.tar`` -> ``dir/shard-000001.sums`` (beside the ``.idx``)."""
    head, tail = posixpath.split(tar_path)
    stem = tail[:-4] if tail.endswith(".tar") else tail
    return posixpath.join(head, stem + ".sums")


def render_sums(values: array) -> bytes:
    """The sidecar's bytes for ``values`` (``array("I")`` of CRC32s, one per member)."""
    body = values if sys.byteorder == "little" else _swapped(values)
    return _HEADER.pack(MAGIC, VERSION, _ALGORITHM_IDS[ALGORITHM], 0, len(values)) + body.tobytes()


def parse_sums(data: bytes, shard: str) -> array:
    """The CRC32s of a sidecar; IndexMismatchError naming the shard if it is not a valid one."""
    name = posixpath.basename(sums_path_for(shard))
    if len(data) < _HEADER.size:
        raise IndexMismatchError(f"{name} is {len(data)} bytes, too short for its header", shard=shard)
    magic, version, algorithm, _, count = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise IndexMismatchError(f"{name} is not a checksums file of version {VERSION}", shard=shard)
    if algorithm != _ALGORITHM_IDS[ALGORITHM]:
        raise IndexMismatchError(
            f"{name} uses checksum algorithm {algorithm}, this build reads crc32", shard=shard
        )
    if len(data) != _HEADER.size + 4 * count:
        raise IndexMismatchError(
            f"{name} is {len(data)} bytes, its header says {count} checksums ({_HEADER.size + 4 * count})",
            shard=shard,
        )
    values = array("I")
    values.frombytes(data[_HEADER.size :])
    return values if sys.byteorder == "little" else _swapped(values)


def _swapped(values: array) -> array:
    out = array("I", values)
    out.byteswap()
    return out


def mismatch(
    shard: str, key: str, field: str, offset: int, got: int, want: int, size: int
) -> ChecksumMismatchError:
    """The error for a member whose data differs from what was written (names shard, sample,
    field and the member's data offset)."""
    return ChecksumMismatchError(
        f"field {field!r} ({size} bytes) has crc32 {got:08x}, written as {want:08x}: the sample is damaged",
        shard=shard,
        key=key,
        offset=offset,
    )


class MemberSums:
    """A shard's recorded checksums, checked as members are read (``TarShardReader``'s
    ``member_check``): ``self(j, key, field, data, offset)`` for the ``j``-th member of the index."""

    def __init__(self, values: array, shard: str) -> None:
        self.values = values
        self.shard = shard

    def __len__(self) -> int:
        return len(self.values)

    def __call__(self, j: int, key: str, field: str, data: bytes | memoryview, offset: int) -> None:
        if j >= len(self.values):
            raise IndexMismatchError(
                f"the index has more members than the {len(self.values)} checksums recorded",
                shard=self.shard,
                key=key,
                offset=offset,
            )
        got = checksum(data)
        if got != self.values[j]:
            raise mismatch(self.shard, key, field, offset, got, self.values[j], len(data))


_told_unchecked = False  # whether a shard read unchecked was logged (once per process)


def remote_member_check(fs: fsspec.AbstractFileSystem, tar_path: str, shard: str) -> MemberSums | None:
    """The check of a remote tar's members against its ``.sums`` (read once, now), for reads
    that cannot be pinned to a version; None (logged) when the shard has no ``.sums`` (a tar
    written by another tool): its reads are then unchecked."""
    global _told_unchecked
    try:
        data = remote.read_file(fs, sums_path_for(tar_path), shard=shard)
    except MissingShardError:
        if not _told_unchecked:  # once per process: a dataset has thousands of shards
            _told_unchecked = True
            log.info(
                "%s: the store reports no version to pin reads to and the shard has no %s: a "
                "rewrite in place with the same size would not be noticed (said once; shards "
                "written by `stallfree shard` have checksums)",
                shard,
                posixpath.basename(sums_path_for(tar_path)),
            )
        return None
    return MemberSums(parse_sums(data, shard), shard)
