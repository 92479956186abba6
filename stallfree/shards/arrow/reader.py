"""Random access into one Arrow shard (``ArrowShardReader``), and the one opener of "an Arrow IPC
file, an IPC stream or a Parquet file" (``open_batches``) that every Arrow reader here uses.

Local files are memory-mapped (zero-copy columns); remote ones are read through
``remote.RangeFile``. An IPC file's footer blocks are checked inside the file and apart, and a
record batch is validated before any of its rows is converted, once per open (``arrow.check``):
a damaged one is an error, never a read outside its buffers.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec

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
from stallfree.shards.scan import check_record
from stallfree.storage import stamps
from stallfree.storage.fs import is_local
from stallfree.storage.remote import RangeFile, VersionPin, read_ranges

log = logging.getLogger(__name__)


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


# An IPC stream's first message starts with this continuation marker (Arrow >= 0.15 writers;
# older streams start with the message's length); an IPC file starts (and ends) with its magic
STREAM_MARK = b"\xff\xff\xff\xff"
FILE_MAGIC = b"ARROW1"


class _NotAStream(Exception):
    """The file does not start like an IPC stream (so it is neither format)."""


class _IpcStream:
    """An Arrow IPC *stream* (what Hugging Face ``datasets.save_to_disk`` writes): no footer, so
    it is walked once when opened to learn where each record batch's message lies. Locally the
    batches are then zero-copy views of the memory map; remotely only the offsets are kept and a
    batch is one ranged read of its message, decoded against the schema."""

    thread_safe = True

    def __init__(
        self,
        source: Any,
        local: bool,
        fetch: Any,
        shard: str,
        walk_open: Any = None,
        *,
        partial: bool = False,
    ) -> None:
        self._fetch = fetch
        self._batches: list[Any] | None = [] if local else None
        self._spans: list[tuple[int, int]] = []
        self._rows: list[int] = []
        self._partial = partial
        self.damage: DamagedArrowError | None = None
        source.seek(0)
        head = source.read(len(STREAM_MARK))
        if head != STREAM_MARK and (len(head) < 4 or head == FILE_MAGIC[:4]):
            raise _NotAStream  # an IPC file without its footer, or too short to be anything
        if head != STREAM_MARK and walk_open is not None:
            raise _NotAStream  # remote: no second file opened for what is not a current stream
        if walk_open is not None:  # remote: walk through a read-ahead file, not a request per message
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
                damage = DamagedArrowError(
                    f"damaged Arrow IPC stream: the message of record batch {len(self._rows)} does not "
                    f"parse, so no later batch can be found: {exc}",
                    shard=shard,
                    offset=start,
                )
                if not self._partial:
                    raise damage from None
                self.damage = damage
                return
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

    def __init__(self, source: Any, columns: Sequence[str] | None = None) -> None:
        import pyarrow.parquet as pq

        self._file = pq.ParquetFile(source)
        self._columns = list(columns) if columns is not None else None
        self.schema = self._file.schema_arrow
        self.num_record_batches = self._file.metadata.num_row_groups
        self._last: tuple[int, Any] | None = None

    def get_batch(self, b: int):
        if self._last is not None and self._last[0] == b:
            return self._last[1]
        import pyarrow as pa

        batches = (
            self._file.read_row_group(b, columns=self._columns).combine_chunks().to_batches()
        )  # one, or none if empty
        batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=self.schema)
        self._last = (b, batch)
        return batch

    def batch_rows(self, b: int) -> int:
        return self._file.metadata.row_group(b).num_rows

    def offset_of(self, b: int) -> int | None:
        return None


def open_batches(
    source: Any,
    path: str,
    shard: str,
    local: bool,
    fetch: Any,
    walk_open: Any = None,
    *,
    partial: bool = False,
    columns: Sequence[str] | None = None,
) -> Any:
    """The one opener of a table file, whichever of the layouts users have: Arrow IPC file
    (ours), Arrow IPC stream (Hugging Face ``save_to_disk``), Parquet (``.parquet``). Returns an
    object with ``schema``, ``num_record_batches``, ``get_batch(b)``, ``batch_rows(b)`` and
    ``offset_of(b)`` (the byte offset of batch ``b``'s message, where known).

    The layout is read off the file, never found by trying: an IPC file ends with its footer and
    magic, checked before pyarrow trusts them (``arrow.check.check_ipc_file``); without that
    trailer it is read as a stream (first bytes: the continuation mark). Why not "open_file,
    then the stream if that fails": a failed ``open_file`` on a memory map left its read on
    pyarrow's IO threads, keeping the map alive past close (the tokens reader's
    ``test_cut_short`` was flaky for it). ``source``: a pyarrow random-access file (a memory map,
    a ``BufferReader``, a ``PythonFile``). ``local``: keep a stream's batches (zero-copy views of
    a memory map) rather than their spans, read again with ``fetch(start, end)``. ``walk_open``:
    a read-ahead file for walking a remote stream once. ``partial``: a stream message that does
    not parse ends the walk and is kept as ``damage`` (the batches before it are readable)
    instead of raised. ``columns``: read only these of a Parquet file (an IPC batch's columns are
    views, not reads). Anything else unreadable is a ``CorruptShardError`` naming the shard."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from stallfree.shards.arrow.check import check_ipc_file

    try:
        if path.endswith(".parquet"):
            return _ParquetGroups(source, columns)
        blocks = check_ipc_file(lambda at, n: source.read_at(n, at), source.size(), shard, head=local)
        if blocks is not None:  # it ends like an IPC file, with a sound footer
            return _IpcFile(ipc.open_file(source), blocks, shard)
        try:
            return _IpcStream(source, local, fetch, shard, walk_open, partial=partial)
        except pa.ArrowException as exc:
            if isinstance(exc, OSError | ValueError):
                raise
            # ArrowNotImplementedError: a stream's schema with a type no pyarrow reads (damage)
            raise DamagedArrowError(f"damaged Arrow IPC stream: {exc}", shard=shard) from None
        except _NotAStream:
            raise unreadable_table(
                path, shard, "it starts like neither, or it is an IPC file cut short before its footer"
            ) from None
    except (pa.ArrowException, OSError) as exc:
        raise unreadable_table(path, shard, exc) from None


def _rows_per_batch(schema: Any) -> int | None:
    """The rows per record batch our writer records in the schema (``writer.ROWS_PER_BATCH``), or
    None: another writer's file, or a value that is not a positive count."""
    from stallfree.shards.arrow.writer import ROWS_PER_BATCH

    raw = (schema.metadata or {}).get(ROWS_PER_BATCH)
    if raw is None or not raw.isdigit() or len(raw) > 9:
        return None
    return int(raw) or None


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
        check_record(fs, path, self.size, info, verify_hash)
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
        per = _rows_per_batch(self._schema)
        self._per = 1  # rows of every batch but the last, when _starts is None
        if expected is not None and nb == expected:
            self._starts = None  # one row per batch: batch index == row
            self.rows = nb
        elif per is not None and nb and (expected is None or -(-expected // per) == nb):
            # our writer's layout: every batch holds ``per`` rows, the last one fewer (each
            # batch's count is checked when it is read); opening reads the footer only
            self._starts, self._per = None, per
            self.rows = (nb - 1) * per + self._rows_of(nb - 1)  # one batch read: checks the count
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
        return read_ranges(self.fs, self.path, [(start, end)], shard=self.shard, pin=self.pin)[0]

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
            first = b * self._per
            rows = min(self._per, self.rows - first)
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
            b, r = divmod(row, self._per)
            return self._convert(self._batch(b), r, row)
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
                b, r = divmod(row, self._per)
                batch = self._batch(b)
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
