"""Random access into one tar shard through its ``.idx`` offsets (``TarShardReader``).

Local shards are read with ``os.pread`` (one call per sample, no memory map: see
``TarShardReader.__init__``); remote ones (any fsspec URL) with ranged requests: one sample is
one ``remote.read_range`` (length checked, short or failed reads retried) spanning its members
(headers included, so each member's name is checked against the index for free); ``get_many``
merges neighbouring samples into one request (``remote.read_ranges``).

Opening checks the shard cheaply: size against the manifest, index entries inside the file, the
first and last sample's member headers name the member the index says.
"""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import fsspec
import numpy as np

from stallfree.errors import (
    CorruptShardError,
    IndexMismatchError,
    MissingShardError,
)
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.scan import check_record, scan_tar
from stallfree.shards.tar.idx import IDX_VERSION, IdxSample, idx_path_for, parse_idx
from stallfree.shards.tar.sums import remote_member_check
from stallfree.shards.tar.walk import RangeReader, walk_tar
from stallfree.shards.tar.writer import BLOCK, parse_header, split_name
from stallfree.storage import stamps
from stallfree.storage.fs import is_local
from stallfree.storage.ranges import coalesce
from stallfree.storage.remote import VersionPin, read_file, read_ranges

log = logging.getLogger(__name__)


def _decimals(tokens: list[str]) -> np.ndarray | None:
    """Plain ASCII decimal tokens -> int64 values in one C-level parse (``map(int, ...)`` took
    ~70 ns a token); None for anything else (signs, ``_``, non-ASCII digits, 10**18 or more)."""
    joined = " ".join(tokens)
    if not (joined.isascii() and joined.replace(" ", "").isdigit()):
        return None
    values = np.fromstring(joined, dtype=np.int64, sep=" ")
    # numpy saturates on overflow: anything that large is not a tar offset anyway
    if len(values) != len(tokens) or values.max() >= 10**18:
        return None
    return values


def uniform_columns(
    text: bytes | str, size: int, expected: int | None
) -> tuple[list[str], list[str], array, array, array, array] | None:
    """The reader's index columns straight from ``.idx`` text, in bulk, when every sample has the
    same fields in the same order (what our writer and ``wds2idx`` produce for uniform data) and
    everything checks out: ``(keys, field names, field ids, data starts, data ends, first member
    of each row)``. None for anything else (other layouts, malformed lines, entries past ``size``
    bytes, a count other than ``expected``): the caller then parses with ``parse_idx``, which
    names the problem. Why: parsing member by member cost ~2 µs per sample, a third of a first
    sequential pass over freshly opened 100 KB-sample shards."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    lines = text.splitlines()
    if not lines:
        return None
    head = lines[0].split()
    if len(head) != 2 or head[0] != IDX_VERSION or not head[1].isdigit():
        return None
    count = int(head[1])
    rows = list(map(str.split, lines[1:]))
    if not count or len(rows) != count or (expected is not None and count != expected):
        return None
    width = len(rows[0])
    if not width or width % 4 or set(map(len, rows)) != {width}:
        return None
    m = width // 4
    tokens = list(chain.from_iterable(rows))
    fields = tokens[0::4]
    pattern = fields[:m]
    if len(set(pattern)) != m or fields != pattern * count:
        return None
    numbers = _decimals(tokens[1::4] + tokens[2::4])  # data offsets, then sizes
    if numbers is None:
        return None
    starts, lengths = numbers[: len(numbers) // 2], numbers[len(numbers) // 2 :]
    if starts.min() < BLOCK:
        return None
    ends = starts + lengths
    if ends.max() > size:
        return None
    names = tokens[3::4]
    cut = len(pattern[0]) + 1
    keys = [name[:-cut] for name in names[0::m]]
    for k, field in enumerate(pattern):
        # every member name is KEY.FIELD (joined with newlines, which no token contains)
        suffix = "." + field
        if "\n".join(names[k::m]) != (suffix + "\n").join(keys) + suffix:
            return None
    start_col, end_col = array("q"), array("q")
    start_col.frombytes(starts.tobytes())
    end_col.frombytes(ends.tobytes())
    fid = array("H", range(m)) * count
    first = array("q", range(0, m * count + 1, m))
    return keys, pattern, fid, start_col, end_col, first


def _weak(pin: VersionPin) -> bool:
    """A pin that cannot see every rewrite: ``Last-Modified`` alone has one-second resolution,
    so a shard rewritten within the second it was opened passes ``If-Unmodified-Since``; its
    members are checked against the ``.sums`` too."""
    return pin.etag is None and pin.version_id is None


class TarShardReader:
    """Random access to one tar shard through its index (``.idx``, or headers scanned if absent).

    ``member_check(j, key, field, data, offset)``, when given, sees every member read (``j``: its
    place in the index, members flattened in order) and raises to refuse it (``sums.MemberSums``:
    ``open_dataset(..., verify_samples=True)``).

    Remote reads are pinned to the version of the object found when the reader opened
    (``stamps.open_version``): a shard rewritten mid-run is ``remote.ObjectChangedError``, not
    new bytes; where the store offers no version to pin, or only a ``Last-Modified`` (``_weak``),
    every member is checked against the shard's ``.sums`` (``sums.remote_member_check``) unless
    ``member_check`` is given."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        shard: str,
        info: ShardInfo | None = None,
        samples: list[IdxSample] | None = None,
        verify_hash: bool = False,
        member_check: Callable[[int, str, str, bytes, int], None] | None = None,
    ) -> None:
        self.fs, self.path, self.shard, self.info = fs, path, shard, info
        self.member_check = member_check
        self.pin: VersionPin | None = None  # what every remote read asks for
        self.local = is_local(fs)
        # Local shards are read with pread, not through a memory map: a mapping leaves every page
        # a worker has read resident in it, so RSS/PSS grows to the data set size (measured: +380
        # MiB over one epoch of 4,000 ImageNet-sized JPEGs) and a file cut short under it is a
        # SIGBUS instead of an error; pread costs about what the map's page faults did.
        self._file = None  # an unbuffered file object: closed with the reader, or when collected
        self._fd: int | None = None
        if self.local:
            try:
                self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - lives as long as the reader
            except FileNotFoundError:
                raise MissingShardError("shard not found", shard=shard) from None
            self._fd = self._file.fileno()
            self.size = os.fstat(self._fd).st_size
        else:
            opened = stamps.open_version(fs, path, shard)
            self.size, self.pin = opened.size, opened.pin
        try:  # any check below may fail: the file must not outlive the error (nor the traceback)
            if not self.local and self.member_check is None and (self.pin is None or _weak(self.pin)):
                self.member_check = remote_member_check(fs, path, shard)
            self._load_index(samples, verify_hash)
        except BaseException:
            self.close()
            raise

    def _load_index(self, samples: list[IdxSample] | None, verify_hash: bool) -> None:
        """Check size (and sha256 if asked), then build the index columns and check the first and
        last sample's headers against them."""
        fs, path, shard, info, size = self.fs, self.path, self.shard, self.info, self.size
        check_record(fs, path, size, info, verify_hash)
        columns = None
        if samples is None:
            text = self._load_idx_text()
            if text is not None:
                columns = uniform_columns(text, size, info.samples if info is not None else None)
                if columns is None:  # something unusual: the full parser names any problem
                    samples = parse_idx(text, shard)
            else:
                samples = scan_tar(fs, path, shard)
        # every row has the same fields in the same order (the bulk index path checked it)
        self._uniform = columns is not None
        if columns is not None:
            self._keys, self._names, self._fid, self._starts, self._ends, self._first = columns
        else:
            self._columns_from_samples(samples, size, info)
        if self._keys:
            self._check_header(0)
            self._check_header(len(self._keys) - 1)

    def _columns_from_samples(self, samples: list[IdxSample], size: int, info: ShardInfo | None) -> None:
        shard = self.shard
        if info is not None and len(samples) != info.samples:
            raise IndexMismatchError(
                f"the index lists {len(samples)} samples, the manifest says {info.samples}", shard=shard
            )
        # Compact columns (a 1.2M-sample dataset must fit in every worker): keys, then per member
        # (flattened, in order) field id, data start and end; ``first[r]:first[r+1]`` are row r's.
        keys: list[str] = []
        names: dict[str, int] = {}
        fid, starts, ends, first = array("H"), array("q"), array("q"), array("q", [0])
        for smp in samples:
            keys.append(smp.key)
            for field, off, length, name in smp.members:
                end = off + length
                if end > size:
                    self._past_end(smp.key, name, off, end)
                fid.append(names.setdefault(field, len(names)))
                starts.append(off)
                ends.append(end)
            first.append(len(starts))
        self._keys, self._fid, self._starts, self._ends, self._first = keys, fid, starts, ends, first
        self._names = list(names)

    def _past_end(self, key: str, name: str, off: int, end: int) -> None:
        """An index entry runs past the end of the file: the tar was cut short, or the index
        belongs to another tar. The walker tells which (it raises for a truncated or corrupt
        archive, as everywhere else); if the archive is whole, the index is wrong."""
        walker = RangeReader(self.fs, self.path, self.size, self.shard)
        try:
            for _ in walk_tar(walker, self.shard):
                pass
        finally:
            walker.close()
        raise IndexMismatchError(
            f"the index says member {name!r} spans bytes {off}..{end}, but the tar ends at byte "
            f"{self.size} and is whole (its headers walk to the end-of-archive block): the index "
            "does not belong to this tar",
            shard=self.shard,
            key=key,
            offset=off - BLOCK,
        )

    def _load_idx_text(self) -> bytes | None:
        """The ``.idx`` file's bytes, or None (with a warning) when the shard has none."""
        try:
            return read_file(self.fs, idx_path_for(self.path), shard=self.shard)
        except MissingShardError:
            log.warning(
                "%s has no .idx; scanning its headers (run `stallfree index` to write one)", self.shard
            )
            return None

    def _read(self, start: int, end: int, key: str | None = None) -> bytes:
        if self._fd is not None:
            return self._pread(start, end, key)
        return read_ranges(self.fs, self.path, [(start, end)], shard=self.shard, keys=[key], pin=self.pin)[0]

    def _pread(self, start: int, end: int, key: str | None = None) -> bytes:
        data = os.pread(self._fd, end - start, start)
        if len(data) != end - start:  # the file shrank after it was opened and checked
            eof = min(start + len(data), os.fstat(self._fd).st_size)
            raise CorruptShardError(
                f"file ends at byte {eof}, the index says data runs to {end} (cut short after it was opened)",
                shard=self.shard,
                key=key,
                offset=eof,
            )
        return data

    def span(self, row: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` of row's members, from its first header to its last data byte."""
        return self._starts[self._first[row]] - BLOCK, self._ends[self._first[row + 1] - 1]

    def _check_header(self, row: int) -> None:
        key, j = self._keys[row], self._first[row]
        field, off, end = self._names[self._fid[j]], self._starts[j], self._ends[j]
        header = self._read(off - BLOCK, off, key)
        try:
            name, size, _ = parse_header(header, off - BLOCK, self.shard, key)
        except CorruptShardError as exc:
            raise IndexMismatchError(
                f"the index points at byte {off} for {key}.{field}, but no valid tar header precedes it "
                f"({exc.reason})",
                shard=self.shard,
                key=key,
                offset=off - BLOCK,
            ) from None
        # a name over 100 bytes came from a pax/GNU long-name record; the header holds only a stub
        long_name = len(f"{key}.{field}".encode("utf-8", "surrogateescape")) > 100
        if split_name(name) != (key, field) and not long_name:
            raise IndexMismatchError(
                f"the index says {key + '.' + field!r} is at byte {off}, the tar has {name!r} there",
                shard=self.shard,
                key=key,
                offset=off - BLOCK,
            )
        if size != end - off:
            raise IndexMismatchError(
                f"the index says {key + '.' + field!r} is {end - off} bytes, its tar header says {size}",
                shard=self.shard,
                key=key,
                offset=off - BLOCK,
            )

    def __len__(self) -> int:
        return len(self._keys)

    def key_of(self, row: int) -> str:
        """Row's sample key, from the index (no read)."""
        return self._keys[row]

    def get(self, row: int) -> dict[str, Any]:
        if self._fd is None:
            start, end = self.span(row)
            return self._slice(row, self._read(start, end, self._keys[row]), start)
        key = self._keys[row]
        sample: dict[str, Any] = {"__key__": key}
        names, fid, starts, ends, pread = self._names, self._fid, self._starts, self._ends, self._pread
        check = self.member_check
        for j in range(self._first[row], self._first[row + 1]):
            sample[names[fid[j]]] = data = pread(starts[j], ends[j], key)
            if check is not None:
                check(j, key, names[fid[j]], data, starts[j])
        return sample

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        """Every row in order, one at a time."""
        get = self.get
        for row in range(len(self._keys)):
            yield get(row)

    def _slice(self, row: int, data: bytes, base: int) -> dict[str, Any]:
        """Row's fields out of ``data`` (bytes from ``base``), checking each member's header name."""
        key = self._keys[row]
        sample: dict[str, Any] = {"__key__": key}
        view = memoryview(data)
        for j in range(self._first[row], self._first[row + 1]):
            field, off, stop = self._names[self._fid[j]], self._starts[j], self._ends[j]
            raw = f"{key}.{field}".encode("utf-8", "surrogateescape")
            h = off - BLOCK - base
            if len(raw) <= 100 and (
                data[h : h + len(raw)] != raw or (len(raw) < 100 and data[h + len(raw)] != 0)
            ):
                found = bytes(view[h : h + 100]).split(b"\0", 1)[0]
                raise IndexMismatchError(
                    f"the index says {raw.decode(errors='replace')!r} is at byte {off}, the tar has {found!r}",
                    shard=self.shard,
                    key=key,
                    offset=off - BLOCK,
                )
            sample[field] = value = bytes(view[off - base : stop - base])
            if self.member_check is not None:
                self.member_check(j, key, field, value, off)
        return sample

    def get_many(self, rows: list[int]) -> list[dict[str, Any]]:
        """Samples for ``rows`` (in that order); remotely, neighbours share one ranged read."""
        if self._fd is not None:
            return [self.get(r) for r in rows]
        groups = coalesce([(*self.span(r), r) for r in set(rows)])
        keys = [self._keys[g[2][0]] for g in groups]
        blobs = read_ranges(
            self.fs, self.path, [(g[0], g[1]) for g in groups], shard=self.shard, keys=keys, pin=self.pin
        )
        found: dict[int, dict[str, Any]] = {}
        for (start, _, tags), blob in zip(groups, blobs, strict=True):
            for r in tags:
                found[r] = self._slice(r, blob, start)
        out, handed = [], set()
        for r in rows:  # a row asked for twice gets its own dict the second time (callers may mutate)
            out.append(found[r] if r not in handed else dict(found[r]))
            handed.add(r)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file, self._fd = None, None
