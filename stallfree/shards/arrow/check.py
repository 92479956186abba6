"""Checks that keep a damaged Arrow table file from crashing the interpreter.

pyarrow trusts a record batch's offsets: ``col[i].as_py()`` on a binary column whose offsets
point outside its data buffer reads whatever lies there (SIGSEGV, SIGBUS past a memory map's
end) or asks for an absurd string length (SIGABRT, ``std::length_error``). So every batch is
validated (``RecordBatch.validate(full=True)``: offsets, buffer sizes, UTF-8, nested lengths)
before a row of it is converted, once per batch per open (``BatchChecks``), and a failure is a
``CorruptShardError`` naming the shard, the batch, its rows and (for IPC files) its byte offset,
which the loader's ``on_error="skip"`` can skip like any other bad sample.

An IPC file's footer is also read here, before pyarrow opens the file (``ipc_file_blocks``): the
blocks it lists must lie inside the file, after the magic and before the footer, and must not
overlap. pyarrow (14 and 26 alike) refuses blocks past the end itself, but not two blocks naming
one message: a footer that points batch 7 at batch 6's message serves batch 6's row as row 7,
silently (``tests/shards/test_arrow_fuzz.py``). The offsets also let errors name the byte offset
of a damaged batch. Neither pyarrow 14 nor 26 crashed on a damaged footer in 600 fuzzed cases:
the crashes were all in converting rows of unvalidated batches.
"""

from __future__ import annotations

import io
import logging
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from stallfree.errors import CorruptShardError

logger = logging.getLogger(__name__)

MAGIC = b"ARROW1"
_TAIL = 10  # int32 footer length + "ARROW1"
_HEAD = 8  # "ARROW1" + 2 bytes of padding
TAIL_READ = 64 << 10  # a remote file's last bytes read at once (footer of ~2,600 batches)
# Footer table fields (Arrow's File.fbs): 0 version, 1 schema, 2 dictionaries, 3 recordBatches
_DICTIONARIES, _RECORD_BATCHES = 2, 3
_BLOCK = np.dtype([("offset", "<i8"), ("meta", "<i4"), ("pad", "<i4"), ("body", "<i8")])


class DamagedArrowError(CorruptShardError, ValueError):
    """An Arrow table file is damaged (a footer, a record batch, a stream message). Also a
    ``ValueError``, as pyarrow's ``ArrowInvalid`` is, so code that caught pyarrow's errors that
    way (a label heuristic over every batch, say) still catches this one."""


@dataclass(frozen=True)
class FooterBlocks:
    """Where an IPC file's record batches lie: ``offsets[b]`` and ``ends[b]`` (int64 arrays) of
    batch ``b``'s message (metadata and body), as the footer lists them."""

    offsets: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    def offset_of(self, b: int) -> int | None:
        return int(self.offsets[b]) if 0 <= b < len(self.offsets) else None


def _footer_error(message: str, shard: str, offset: int | None) -> CorruptShardError:
    return DamagedArrowError(f"damaged Arrow IPC file footer: {message}", shard=shard, offset=offset)


def footer_span(size: int, tail: bytes, shard: str) -> tuple[int, int] | None:
    """``(start, length)`` of the footer from the file's last bytes ``tail`` (at least the last
    10), or None when the file does not end like an IPC file (it may be a stream)."""
    if size < _HEAD + _TAIL or len(tail) < _TAIL or tail[-6:] != MAGIC:
        return None
    (length,) = struct.unpack_from("<i", tail, len(tail) - _TAIL)
    start = size - _TAIL - length
    if length <= 0 or start < _HEAD:
        raise _footer_error(
            f"its length field says {length} bytes, the file has {size - _TAIL - _HEAD} before it",
            shard,
            size - _TAIL,
        )
    return start, length


def ipc_file_blocks(size: int, footer: bytes, start: int, head: bytes, shard: str) -> FooterBlocks:
    """Parse and check the footer flatbuffer ``footer`` (which starts at byte ``start`` of a file
    of ``size`` bytes whose first bytes are ``head``): every read bounded by the footer's own
    length, every block inside ``[8, start)`` and none overlapping another."""
    if head[:6] != MAGIC:
        raise DamagedArrowError(
            "ends like an Arrow IPC file but does not start with ARROW1", shard=shard, offset=0
        )
    n = len(footer)

    def u32(at: int, what: str) -> int:
        if not 0 <= at <= n - 4:
            raise _footer_error(f"{what} points outside the footer", shard, start + max(at, 0))
        return struct.unpack_from("<I", footer, at)[0]

    table = u32(0, "root table offset")
    vtable = table - struct.unpack_from("<i", footer, table)[0] if 0 <= table <= n - 4 else -1
    if not 0 <= vtable <= n - 4:
        raise _footer_error("the root table or its vtable lies outside the footer", shard, start)
    vt_size = struct.unpack_from("<H", footer, vtable)[0]
    if vt_size < 4 or vtable + vt_size > n:
        raise _footer_error(
            f"vtable of {vt_size} bytes at {vtable} runs past the footer", shard, start + vtable
        )

    def vector(field: int) -> np.ndarray:
        slot = 4 + 2 * field
        if slot + 2 > vt_size:
            return np.empty(0, _BLOCK)
        (rel,) = struct.unpack_from("<H", footer, vtable + slot)
        if rel == 0:
            return np.empty(0, _BLOCK)
        at = table + rel
        vec = at + u32(at, "a block list")
        count = u32(vec, "a block list's length")
        if count > (n - vec - 4) // _BLOCK.itemsize:
            raise _footer_error(f"a block list of {count} entries runs past the footer", shard, start + vec)
        return np.frombuffer(footer, _BLOCK, count, vec + 4)

    batches, dictionaries = vector(_RECORD_BATCHES), vector(_DICTIONARIES)
    blocks = np.concatenate([batches, dictionaries])
    offsets = blocks["offset"]
    ends = offsets + blocks["meta"].astype(np.int64) + blocks["body"]
    bad = (offsets < _HEAD) | (blocks["meta"] <= 0) | (blocks["body"] < 0) | (ends > start) | (ends < offsets)
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        what = f"record batch {b}" if b < len(batches) else f"dictionary batch {b - len(batches)}"
        raise _footer_error(
            f"{what} is listed at bytes {int(offsets[b])}..{int(ends[b])} (metadata "
            f"{int(blocks['meta'][b])}, body {int(blocks['body'][b])} bytes), outside the file's "
            f"data (bytes {_HEAD}..{start})",
            shard,
            start,
        )
    order = np.argsort(offsets, kind="stable")
    overlap = np.flatnonzero(ends[order][:-1] > offsets[order][1:])
    if overlap.size:
        a, b = int(order[overlap[0]]), int(order[overlap[0] + 1])
        raise _footer_error(
            f"two blocks overlap (bytes {int(offsets[a])}..{int(ends[a])} and "
            f"{int(offsets[b])}..{int(ends[b])})",
            shard,
            start,
        )
    k = len(batches)
    return FooterBlocks(offsets[:k].copy(), ends[:k].copy())


def check_ipc_file(read_at: Any, size: int, shard: str, *, head: bool = True) -> FooterBlocks | None:
    """The record batch blocks of the IPC file behind ``read_at(offset, length) -> bytes``
    (checked as ``ipc_file_blocks`` says), or None when it does not end like an IPC file.
    ``head=False`` leaves the leading magic unread where it is not in the tail already (a
    remote file: pyarrow never reads it, so checking it would cost a request)."""
    tail_len = min(size, TAIL_READ)
    tail = read_at(size - tail_len, tail_len)
    span = footer_span(size, tail, shard)
    if span is None:
        return None
    start, length = span
    from_tail = start - (size - tail_len)
    footer = tail[from_tail : from_tail + length] if from_tail >= 0 else read_at(start, length)
    if tail_len == size:
        first = tail[:_HEAD]
    else:
        first = read_at(0, _HEAD) if head else MAGIC
    return ipc_file_blocks(size, footer, start, first, shard)


class TailCached(io.RawIOBase):
    """A read-only file over ``raw`` (a ``remote.RangeFile``) that reads its last ``TAIL_READ``
    bytes in one request the first time a read reaches them (``check_ipc_file``'s), and answers
    later reads of the footer and trailer from those bytes: pyarrow's own reads of them (the
    length, then the footer) make no further requests. Everything before the footer (record
    batches) is still read from storage when asked for, as before."""

    def __init__(self, raw: Any, size: int) -> None:
        super().__init__()
        self._raw, self.size = raw, size
        self._tail_start, self._tail = max(0, size - TAIL_READ), None
        self._serve_from = size  # where the footer starts, once the tail is read
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        start = min(self._pos, self.size)
        end = self.size if n is None or n < 0 else min(self.size, start + n)
        first = self._tail is None and start >= self._tail_start
        if first:
            self._raw.seek(self._tail_start)
            self._tail = self._raw.read(self.size - self._tail_start)
            self._serve_from = self._footer_start(self._tail)
        if first or (self._tail is not None and start >= self._serve_from):
            data = self._tail[start - self._tail_start : end - self._tail_start]
        else:
            self._raw.seek(start)
            data = self._raw.read(end - start)
        self._pos = start + len(data)
        return data

    def _footer_start(self, tail: bytes) -> int:
        """Where the footer starts per ``tail`` (the trailer alone where it names no sane one)."""
        trailer = max(0, self.size - _TAIL)
        if len(tail) < _TAIL or tail[-6:] != MAGIC:
            return trailer
        (length,) = struct.unpack_from("<i", tail, len(tail) - _TAIL)
        start = trailer - length
        return start if 0 < length and start >= self._tail_start else trailer

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)

    def close(self) -> None:
        self._raw.close()
        super().close()


def validate_batch(
    batch: Any,
    *,
    shard: str,
    batch_no: int,
    first_row: int | None = None,
    rows: int | None = None,
    offset: int | None = None,
) -> None:
    """Raise ``CorruptShardError`` unless ``batch`` is a valid record batch (of ``rows`` rows when
    that is known), so converting its rows cannot read outside its buffers."""
    import pyarrow as pa

    problem = None
    if rows is not None and batch.num_rows != rows:
        problem = f"it holds {batch.num_rows} rows where {rows} were expected"
    else:
        try:
            batch.validate(full=True)
        except (pa.ArrowException, ValueError, TypeError) as exc:  # kinds vary by pyarrow version
            problem = str(exc)
    if problem is not None:
        raise DamagedArrowError(
            f"record batch {batch_no}{row_span(first_row, rows if rows is not None else batch.num_rows)} "
            f"is damaged: {problem}",
            shard=shard,
            offset=offset,
        )


def check_schema_names(schema: Any, shard: str) -> None:
    """Raise ``DamagedArrowError`` unless every field name in ``schema``, nested ones included,
    is UTF-8. ``validate(full=True)`` checks a batch's buffers, not its schema, and pyarrow
    decodes a name only when asked: a flipped byte in a struct field's name passed every check
    and then was a ``UnicodeDecodeError`` from converting a row (found fuzzing a Hugging Face
    stream). A walk without recursion: a damaged schema may nest deep."""
    import pyarrow as pa

    pending = list(schema)
    while pending:
        field = pending.pop()
        try:
            field.name  # noqa: B018 - the decode is the check
        except UnicodeDecodeError as exc:
            raise DamagedArrowError(
                f"damaged Arrow schema: a field name is not UTF-8 ({exc.reason} at byte {exc.start})",
                shard=shard,
            ) from None
        t = field.type
        if pa.types.is_dictionary(t):
            t = t.value_type
        pending.extend(t.field(i) for i in range(t.num_fields))


STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # what a stream writer's close() writes last


def warn_if_cut_short(source: Any, shard: str, batches: int, end: int) -> None:
    """Log a warning when a stream that parsed to its end lacks the end-of-stream marker: it
    was cut short on a message boundary (a copy or a writer interrupted), which pyarrow reads as
    a clean end, so the batches after the cut would go missing without a word."""
    try:
        size = source.size()
        source.seek(max(0, size - len(STREAM_END)))
        tail = source.read(len(STREAM_END))
        source.seek(end)
    except (OSError, AttributeError, ValueError):  # a file that cannot say its size: not checked
        return
    if tail != STREAM_END:
        logger.warning(
            "%s: the Arrow stream ends at byte %d without its end-of-stream marker, after record "
            "batch %d: it may have been cut short (the %d batches before are read)",
            shard,
            size,
            batches - 1,
            batches,
        )


def row_span(first: int | None, count: int) -> str:
    """`` (row N)`` or `` (rows N..M)`` for messages; empty when the first row is not known."""
    if first is None:
        return ""
    return f" (row {first})" if count == 1 else f" (rows {first}..{first + max(count, 1) - 1})"


class BatchChecks:
    """Which record batches of one open file were validated: each batch once per open (a batch
    of many rows is not validated again per row), a damaged one's error kept and raised again."""

    def __init__(self, count: int) -> None:
        self._good = bytearray(count)
        self._bad: dict[int, CorruptShardError] = {}

    def check(self, batch: Any, b: int, **where: Any) -> Any:
        """``batch`` itself once batch ``b`` is known good; its ``CorruptShardError`` if not."""
        if self._good[b]:
            return batch
        known = self._bad.get(b)
        if known is not None:  # a fresh error each time: one raised twice grows its traceback
            raise DamagedArrowError(known.reason, shard=known.shard, offset=known.offset)
        try:
            validate_batch(batch, batch_no=b, **where)
        except CorruptShardError as exc:
            self._bad[b] = exc
            raise
        self._good[b] = 1
        return batch


__all__ = [
    "BatchChecks",
    "DamagedArrowError",
    "FooterBlocks",
    "TailCached",
    "check_ipc_file",
    "check_schema_names",
    "footer_span",
    "ipc_file_blocks",
    "row_span",
    "validate_batch",
    "warn_if_cut_short",
]
