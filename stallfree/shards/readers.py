"""Per-shard random access: ``TarShardReader`` (via the ``.idx`` offsets) and ``ArrowShardReader``.

Local tar shards are read with ``os.pread`` (one call per sample, no memory map: see
``TarShardReader.__init__``); local Arrow files are memory-mapped (zero-copy columns). Remote
files (any fsspec URL) are read with ranged requests: one sample is one ``remote.read_range``
(length checked, short or failed reads retried) spanning its members (headers included, so each
member's name is checked against the index for free); ``get_many`` merges neighbouring samples
into one request (``remote.read_ranges``), and Arrow/Parquet files are read through
``remote.RangeFile``.

A reader checks its shard cheaply when opened: size against the manifest, index entries inside
the file, the first and last sample's member headers name the member the index says; an Arrow
IPC file's footer blocks inside the file and apart. An Arrow record batch is validated before
any of its rows is converted, once per open (``arrow_check``): a damaged one is an error, never
a read outside its buffers.
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from array import array
from bisect import bisect_right
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
from stallfree.shards.arrow.check import (
    BatchChecks,
    DamagedArrowError,
    check_schema_names,
    row_span,
    warn_if_cut_short,
)
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.scan import record_mismatches, scan_tar, sha256_of
from stallfree.shards.tar.idx import IDX_VERSION, IdxSample, idx_path_for, parse_idx
from stallfree.shards.tar.sums import remote_member_check
from stallfree.shards.tar.walk import RangeReader, walk_tar
from stallfree.shards.tar.writer import BLOCK, parse_header, split_name
from stallfree.storage import stamps
from stallfree.storage.atomic import is_local
from stallfree.storage.remote import RangeFile, VersionPin, read_file, read_ranges

log = logging.getLogger(__name__)

# get_many merges two ranged reads when the gap between them is at most this many bytes.
MAX_GAP = 16 * 1024
MAX_MERGED = 64 << 20


def coalesce(spans: list[tuple[int, int, int]], max_gap: int = MAX_GAP) -> list[tuple[int, int, list[int]]]:
    """``[(start, end, tag)]`` -> merged ``[(start, end, [tags])]`` for reads at most ``max_gap`` apart."""
    merged: list[tuple[int, int, list[int]]] = []
    for start, end, tag in sorted(spans):
        if merged:
            m_start, m_end, tags = merged[-1]
            if start - m_end <= max_gap and max(end, m_end) - m_start <= MAX_MERGED:
                merged[-1] = (m_start, max(end, m_end), tags + [tag])
                continue
        merged.append((start, end, [tag]))
    return merged


def _fetch_ranges(
    fs: fsspec.AbstractFileSystem,
    path: str,
    ranges: list[tuple[int, int]],
    shard: str,
    keys: list[str | None] | None = None,
    pin: VersionPin | None = None,
) -> list[bytes]:
    """Each range's bytes, exactly, through the one checked and retried remote read (of the
    version ``pin`` names, where given)."""
    return read_ranges(fs, path, ranges, shard=shard, keys=keys, pin=pin)


def _check_record(
    fs: fsspec.AbstractFileSystem, path: str, size: int, info: ShardInfo | None, verify_hash: bool
) -> None:
    """The open-time checks both readers make: size against the manifest, then (if asked) sha256;
    raises the first mismatch (``scan.record_mismatches`` words it as ``verify`` does)."""
    if info is None:
        return
    found = record_mismatches(info, size)
    if not found and verify_hash and info.sha256:
        found = record_mismatches(info, size, sha256_of(fs, path, size=size, shard=info.path))
    if found:
        raise found[0]


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
        _check_record(fs, path, size, info, verify_hash)
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
        return _fetch_ranges(self.fs, self.path, [(start, end)], self.shard, [key], self.pin)[0]

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
        blobs = _fetch_ranges(self.fs, self.path, [(g[0], g[1]) for g in groups], self.shard, keys, self.pin)
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


class _IpcFile:
    """An Arrow IPC *file*: its footer lists the record batches (random access for free);
    ``blocks`` is that list as ``arrow_check.ipc_file_blocks`` read and checked it."""

    thread_safe = True

    def __init__(self, reader: Any, blocks: Any, shard: str) -> None:
        self._reader = reader
        self.schema = reader.schema
        self.num_record_batches = reader.num_record_batches
        self._blocks = blocks
        if blocks is not None and len(blocks) != self.num_record_batches:
            raise DamagedArrowError(
                f"the footer lists {len(blocks)} record batches, pyarrow read {self.num_record_batches}",
                shard=shard,
            )

    def get_batch(self, b: int):
        return self._reader.get_batch(b)

    def batch_rows(self, b: int) -> int:
        return self._reader.get_batch(b).num_rows

    def offset_of(self, b: int) -> int | None:
        return None if self._blocks is None else self._blocks.offset_of(b)


# An IPC stream's first message starts with this continuation marker (Arrow >= 0.15 writers)
STREAM_MARK = b"\xff\xff\xff\xff"


class _NotAStream(Exception):
    """The file does not start like an IPC stream (so it is neither format)."""


class _IpcStream:
    """An Arrow IPC *stream* (what Hugging Face ``datasets.save_to_disk`` writes): no footer, so
    it is walked once when opened to learn where each record batch's message lies. Locally the
    batches are then zero-copy views of the memory map; remotely only the offsets are kept and a
    batch is one ranged read of its message, decoded against the schema."""

    thread_safe = True

    def __init__(self, source: Any, local: bool, fetch: Any, shard: str, walk_open: Any = None) -> None:
        self._fetch = fetch
        self._batches: list[Any] | None = [] if local else None
        self._spans: list[tuple[int, int]] = []
        self._rows: list[int] = []
        if walk_open is not None:  # remote: walk through a read-ahead file, not a request per message
            source.seek(0)
            if source.read(4) != STREAM_MARK:  # not a stream: no second file opened to find out
                raise _NotAStream
            walk = walk_open()
            try:
                self._walk(walk, shard)
            finally:
                walk.close()
        else:
            self._walk(source, shard)
        self.num_record_batches = len(self._rows)
        if not local:
            log.info(
                "%s is an Arrow stream (no footer): walked it once to index its %d batches",
                shard,
                self.num_record_batches,
            )

    def _walk(self, source: Any, shard: str) -> None:
        """Read the stream once, noting each batch's ``[start, end)`` bytes and row count. A
        message that does not parse past a readable schema is damage at a known place."""
        import pyarrow as pa
        import pyarrow.ipc as ipc

        source.seek(0)
        reader = ipc.open_stream(source)
        self.schema = reader.schema
        check_stream_schema(self.schema, shard)
        start = source.tell()
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowException, OSError) as exc:
                raise DamagedArrowError(
                    f"damaged Arrow IPC stream: the message of record batch {len(self._rows)} does not "
                    f"parse: {exc}",
                    shard=shard,
                    offset=start,
                ) from None
            end = source.tell()
            self._spans.append((start, end))
            self._rows.append(batch.num_rows)
            if self._batches is not None:
                self._batches.append(batch)
            start = end
        warn_if_cut_short(source, shard, len(self._rows), start)

    def get_batch(self, b: int):
        import pyarrow as pa
        import pyarrow.ipc as ipc

        if self._batches is not None:
            return self._batches[b]
        start, end = self._spans[b]
        message = ipc.read_message(pa.py_buffer(self._fetch(start, end)))
        return ipc.read_record_batch(message, self.schema)

    def batch_rows(self, b: int) -> int:
        return self._rows[b]

    def offset_of(self, b: int) -> int | None:
        return self._spans[b][0]


class _ParquetGroups:
    """A Parquet file read one row group at a time (the unit Parquet can decode), the last one
    kept: a row is in its group, and neighbours usually share it. Not row-level random access:
    each new group costs reading that group."""

    thread_safe = False

    def __init__(self, source: Any) -> None:
        import pyarrow.parquet as pq

        self._file = pq.ParquetFile(source)
        self.schema = self._file.schema_arrow
        self.num_record_batches = self._file.metadata.num_row_groups
        self._last: tuple[int, Any] | None = None

    def get_batch(self, b: int):
        if self._last is not None and self._last[0] == b:
            return self._last[1]
        import pyarrow as pa

        batches = self._file.read_row_group(b).combine_chunks().to_batches()  # one, or none if empty
        batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=self.schema)
        self._last = (b, batch)
        return batch

    def batch_rows(self, b: int) -> int:
        return self._file.metadata.row_group(b).num_rows

    def offset_of(self, b: int) -> int | None:
        return None


def open_batches(source: Any, path: str, shard: str, local: bool, fetch: Any, walk_open: Any = None) -> Any:
    """The record batches of a table file, whichever of the layouts users have: Arrow IPC file
    (ours), Arrow IPC stream (Hugging Face ``save_to_disk``), Parquet (``.parquet``). An IPC
    file's footer is checked before pyarrow trusts it (``arrow_check.check_ipc_file``)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from stallfree.shards.arrow.check import check_ipc_file

    try:
        if path.endswith(".parquet"):
            return _ParquetGroups(source)
        blocks = check_ipc_file(lambda at, n: source.read_at(n, at), source.size(), shard, head=local)
        try:
            return _IpcFile(ipc.open_file(source), blocks, shard)
        except pa.ArrowException as file_exc:
            if blocks is not None:  # it ends like an IPC file, with a sound footer: damaged
                raise unreadable_table(path, shard, file_exc) from None
            try:
                return _IpcStream(source, local, fetch, shard, walk_open)
            except (pa.ArrowException, OSError, _NotAStream):
                raise file_exc from None
    except (pa.ArrowException, OSError) as exc:
        raise unreadable_table(path, shard, exc) from None


def unreadable_table(path: str, shard: str, exc: BaseException) -> CorruptShardError:
    """The error for a table file that is none of the layouts ``open_batches`` reads."""
    if path.endswith(".parquet"):
        return CorruptShardError(f"not a readable Parquet file: {exc}", shard=shard)
    return CorruptShardError(
        f"not a readable Arrow IPC file (neither the file nor the stream format): {exc}", shard=shard
    )


def check_stream_schema(schema: Any, shard: str) -> None:
    """Refuse an Arrow stream with dictionary-encoded columns: its batches cannot be read one at
    a time out of order (each depends on the dictionary batches before it)."""
    import pyarrow as pa

    if any(pa.types.is_dictionary(f.type) for f in schema):
        raise CorruptShardError(
            "Arrow stream with dictionary-encoded columns: random access is not supported "
            "(rewrite it with `stallfree shard ... --format arrow`)",
            shard=shard,
        )


class ArrowShardReader:
    """Random access to one Arrow table file (IPC file, IPC stream, or Parquet by row group): a
    row is ``get_batch(b)`` then row ``r`` of it."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        shard: str,
        info: ShardInfo | None = None,
        verify_hash: bool = False,
    ) -> None:
        import pyarrow as pa

        from stallfree.shards.arrow.check import TailCached

        self.fs, self.path, self.shard, self.info = fs, path, shard, info
        self.local = is_local(fs)
        self.pin: VersionPin | None = None  # what every remote read asks for (as TarShardReader)
        self._lock = threading.Lock()
        self._reader: Any = None
        try:
            if self.local:
                self._source = pa.memory_map(path, "r")
                self.size = self._source.size()
            else:
                # pinned to the version found now: a file rewritten mid-run (same size or not) is
                # ObjectChangedError, never batches decoded from a mix of old and new bytes
                opened = stamps.open_version(fs, path, shard)
                self.size, self.pin = opened.size, opened.pin
                # exact ranged reads (random access to batches), checked like every remote read;
                # the footer's bytes read once (the check, then pyarrow, read them)
                raw = RangeFile(fs, path, self.size, shard=shard, pin=self.pin)
                self._source = pa.PythonFile(TailCached(raw, self.size), mode="r")
        except FileNotFoundError:
            raise MissingShardError("shard not found", shard=shard) from None
        try:  # any check below may fail: the source must not outlive the error (nor the traceback)
            self._open_file(verify_hash)
        except BaseException:
            self.close()
            raise

    def _open_file(self, verify_hash: bool) -> None:
        """Check size (and sha256 if asked), open the table (IPC file, IPC stream or Parquet) and
        count its rows."""
        fs, path, shard, info = self.fs, self.path, self.shard, self.info
        _check_record(fs, path, self.size, info, verify_hash)
        walk_open = None
        if not self.local:

            def walk_open():
                import pyarrow as pa

                f = RangeFile(fs, path, self.size, shard=shard, block_size=8 << 20, pin=self.pin)
                return pa.PythonFile(f, mode="r")

        self._reader = open_batches(self._source, path, shard, self.local, self._fetch, walk_open)
        self._schema = self._reader.schema
        check_schema_names(self._schema, shard)  # validate() does not look at names
        self.batches = nb = self._reader.num_record_batches
        self._checks = BatchChecks(nb)
        expected = info.samples if info is not None else None
        if expected is not None and nb == expected:
            self._starts = None  # one row per batch (how we write): batch index == row
            self.rows = nb
        else:
            starts, total = [], 0
            for b in range(nb):
                starts.append(total)
                total += self._rows_of(b)
            self._starts = starts
            self.rows = total
        from stallfree.shards.arrow.hf import row_media_converter
        from stallfree.shards.arrow.writer import row_converter

        # Hugging Face Image()/Audio() struct cells -> their encoded bytes (a no-op otherwise)
        self._convert = row_media_converter(
            row_converter(self._schema, shard), self._schema, fs, path, shard, self.local
        )
        if expected is not None and self.rows != expected:
            raise IndexMismatchError(
                f"the file holds {self.rows} rows, the manifest says {expected}", shard=shard
            )

    def _fetch(self, start: int, end: int) -> bytes:
        return _fetch_ranges(self.fs, self.path, [(start, end)], self.shard, pin=self.pin)[0]

    def _rows_of(self, b: int) -> int:
        """Batch ``b``'s row count, read to lay out rows when batches are not one row each."""
        import pyarrow as pa

        try:
            rows = self._reader.batch_rows(b)
        except (pa.ArrowException, OSError) as exc:
            raise DamagedArrowError(
                f"cannot read record batch {b} to count its rows: {exc}",
                shard=self.shard,
                offset=self._reader.offset_of(b),
            ) from None
        if rows < 0:
            raise DamagedArrowError(
                f"record batch {b} says it holds {rows} rows",
                shard=self.shard,
                offset=self._reader.offset_of(b),
            )
        return rows

    def _batch(self, b: int):
        """Record batch ``b``, validated (once per open) before any of its rows is converted: a
        damaged one is a ``CorruptShardError``, never a read outside its buffers."""
        import pyarrow as pa

        reader = self._reader
        if reader is None:
            raise ValueError(f"the reader of {self.shard} is closed")
        if self._starts is None:
            first, rows = b, 1
        else:
            first = self._starts[b]
            rows = (self._starts[b + 1] if b + 1 < len(self._starts) else self.rows) - first
        try:
            if self.local and reader.thread_safe:  # memory-mapped reads are
                batch = reader.get_batch(b)
            else:
                with self._lock:  # a Python file (or a one-group cache) underneath: one at a time
                    batch = reader.get_batch(b)
        except (pa.ArrowException, OSError) as exc:
            raise DamagedArrowError(
                f"cannot read record batch {b}{row_span(first, rows)}: {exc}",
                shard=self.shard,
                offset=reader.offset_of(b),
            ) from None
        return self._checks.check(
            batch, b, shard=self.shard, first_row=first, rows=rows, offset=reader.offset_of(b)
        )

    def __len__(self) -> int:
        return self.rows

    def get(self, row: int) -> dict[str, Any]:
        if self._starts is None:
            return self._convert(self._batch(row), 0, row)
        b = bisect_right(self._starts, row) - 1
        return self._convert(self._batch(b), row - self._starts[b], row)

    def get_many(self, rows: list[int]) -> list[dict[str, Any]]:
        return [self.get(r) for r in rows]

    def key_of(self, row: int) -> str | None:
        """Row's sample key without converting the row: the name ``row_converter`` gives rows of
        a file without ``__key__``, or that column of a memory-mapped IPC file (zero-copy); None
        elsewhere (reading it would read the row's batch)."""
        if "__key__" not in self._schema.names:
            return f"{posixpath.splitext(self.shard)[0]}/{row}"
        if not (self.local and isinstance(self._reader, _IpcFile)):
            return None
        try:
            if self._starts is None:
                batch, r = self._batch(row), 0
            else:
                b = bisect_right(self._starts, row) - 1
                batch, r = self._batch(b), row - self._starts[b]
        except CorruptShardError:
            return None  # a damaged batch's key column cannot be trusted to name the row
        key = batch.column("__key__")[r].as_py()
        return None if key is None else str(key)

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        for row in range(self.rows):
            yield self.get(row)

    @property
    def schema(self):
        """The file's Arrow schema (fields, types)."""
        return self._schema

    def close(self) -> None:
        """Close the file and drop the IPC reader: its footer buffers would keep a local file's
        mapping alive after the file is closed."""
        self._reader = None
        self._source.close()
