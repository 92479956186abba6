"""An engine's Arrow record batches written as Arrow shards without a Python value per row.

Spark's ``mapInArrow`` and Ray's blocks hand a partition's rows over as Arrow batches. Turning
each row into a dict of Python values and writing it through ``ShardWriter.write`` (the path
every other source takes) was most of a small-row partition's time: a dict, a key check and a
size estimate per row, then the values converted back to Arrow. Here the rows stay Arrow: keys
are made and checked a column at a time (``pyarrow.compute``; only a key the vectorised test
cannot clear goes through ``check_key``), the sizes the roll-over and batching rules count are
computed per column with numpy, and the batches' slices are handed to ``ArrowShardWriter``
(``append_rows``), which concatenates them into its record batches.

The output is byte-identical to ``ShardWriter.write`` of ``write_engines.samples_of``'s samples
(the tests compare the bytes): the same keys (``__key__``, else ``key``, else
``PPPPP-RRRRRRRRR``), the same shard roll-over (``ShardWriter.write``: ``ArrowFormat``'s
estimate plus 1024 against ``max_bytes``, ``max_samples``) and record-batch boundaries
(``ArrowShardWriter.write``'s rule), found here a run of rows at a time: between two record
batches the shard file does not grow, so each rule is a cumulative sum over the sizes. A
schema this path does not cover (a column type whose Python round trip it does not reproduce
exactly, duplicate column names, a key column that is not text or an integer) is written row by
row as before, as is a batch whose schema differs from the partition's first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stallfree.errors import WriteError
from stallfree.shards.arrow.writer import BATCH_BYTES, BATCH_ROWS, KEY, ArrowShardWriter
from stallfree.shards.naming import check_key
from stallfree.shards.writer import ShardWriter

ROLL_SLACK = 1024  # ShardWriter.write: a shard rolls over when bytes + estimate + this > max_bytes
ROW_ESTIMATE = 256  # ArrowShardWriter.estimate: per row ...
ITEM_ESTIMATE = 16 + 64  # ... and per non-null item (plus its name's length, plus a str/bytes length)
OTHER_NBYTES = 8  # value_nbytes of a number, a bool or a null

# a key every rule of ``check_key`` accepts: printable ASCII without spaces, not absolute, its last
# part non-empty and without a dot, no ``..`` part; anything else is checked by ``check_key``
_SUSPECT_KEY = r"[^!-~]|^/|/$|\.[^/]*$|(^|/)\.\.(/|$)|^$"


def _plain_type(t: pa.DataType) -> bool:
    """Types whose values come back from ``to_pylist`` and ``pa.array`` unchanged."""
    return (
        pa.types.is_integer(t)
        or pa.types.is_float32(t)
        or pa.types.is_float64(t)
        or pa.types.is_boolean(t)
        or _is_text(t)
    )


def _is_text(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


def _is_str(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _key_type_ok(t: pa.DataType) -> bool:
    """Key columns whose ``str(value)`` a cast to string gives: text and integers."""
    return _is_str(t) or pa.types.is_integer(t)


def unsupported(schema: pa.Schema) -> str | None:
    """Why rows of ``schema`` must be written one by one (None: this path writes them)."""
    names = schema.names
    if len(set(names)) != len(names):
        return "duplicate column names"
    for f in schema:
        if f.name in (KEY, "key") and not _key_type_ok(f.type):
            return f"key column {f.name!r} of type {f.type}"
        if f.name != KEY and not _plain_type(f.type):
            return f"column {f.name!r} of type {f.type}"
    return None


@dataclass(frozen=True)
class BadRow:
    """A row whose key no shard may hold: its index in the batch, its number in the partition,
    its key and why."""

    index: int
    row: int
    key: str
    reason: str


@dataclass(frozen=True)
class EngineRows:
    """One engine batch ready for the shard: its rows in the shard's schema (keys made), each
    row's roll-over estimate and data bytes, the rows whose keys are bad, and whether its keys
    came from a column (then a duplicate is possible)."""

    rows: pa.RecordBatch
    estimate: np.ndarray
    nbytes: np.ndarray
    bad: list[BadRow]
    keyed: bool


def _generated_keys(partition: int, first_row: int, n: int) -> pa.Array:
    """``f"{partition:05d}-{row:09d}"`` for rows ``first_row..first_row+n-1``, built as bytes."""
    head = f"{partition:05d}-".encode()
    last = first_row + n - 1
    width = max(9, len(str(last)))
    if n == 0:
        return pa.array([], pa.string())
    digits = np.empty((n, width), np.uint8)
    rows = np.arange(first_row, first_row + n, dtype=np.int64)
    for k in range(width - 1, -1, -1):
        digits[:, k] = rows % 10 + 48
        rows //= 10
    if last >= 10**9:  # past nine digits the format grows row by row: made as Python would
        return pa.array([f"{partition:05d}-{r:09d}" for r in range(first_row, first_row + n)], pa.string())
    size = len(head) + width
    data = np.empty((n, size), np.uint8)
    data[:, : len(head)] = np.frombuffer(head, np.uint8)
    data[:, len(head) :] = digits
    offsets = np.arange(0, (n + 1) * size, size, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _as_key(column: pa.Array) -> pa.Array:
    return column if pa.types.is_string(column.type) else pc.cast(column, pa.string())


def batch_keys(batch: pa.RecordBatch, partition: int, first_row: int) -> tuple[pa.Array, bool]:
    """Each row's key as ``samples_of`` makes it, and whether any came from a column."""
    names = batch.schema.names
    keys = _as_key(batch.column(KEY)) if KEY in names else None
    if "key" in names:
        alt = _as_key(batch.column("key"))
        keys = alt if keys is None else (keys if not keys.null_count else pc.coalesce(keys, alt))
    if keys is None:
        return _generated_keys(partition, first_row, batch.num_rows), False
    if keys.null_count:
        made = _generated_keys(partition, first_row, batch.num_rows)
        keys = pc.coalesce(keys, made)
    return keys, True


def _lengths(column: pa.Array) -> np.ndarray:
    """Each value's ``len``: characters of a string, bytes of binary (0 for a null)."""
    measure = pc.utf8_length if _is_str(column.type) else pc.binary_length
    return pc.fill_null(measure(column), 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _valid(column: pa.Array) -> np.ndarray | None:
    return None if not column.null_count else column.is_valid().to_numpy(zero_copy_only=False)


def prepare_batch(batch: pa.RecordBatch, schema: pa.Schema, partition: int, first_row: int) -> EngineRows:
    """An engine batch (its schema the partition's first's) as rows of the shard's ``schema``."""
    keys, keyed = batch_keys(batch, partition, first_row)
    key_len = _lengths(keys)
    estimate = ROW_ESTIMATE + ITEM_ESTIMATE + len(KEY) + key_len
    nbytes = key_len.copy()
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        if name == KEY:
            continue
        valid = _valid(column)
        item = ITEM_ESTIMATE + len(name)
        if _is_text(column.type):
            length = _lengths(column)
            estimate = estimate + (length + item if valid is None else np.where(valid, length + item, 0))
            nbytes += length if valid is None else np.where(valid, length, OTHER_NBYTES)
        else:
            estimate = estimate + (item if valid is None else np.where(valid, item, 0))
            nbytes += OTHER_NBYTES
    columns = [keys if f.name == KEY else batch.column(f.name) for f in schema]
    rows = pa.RecordBatch.from_arrays(columns, schema=schema)
    return EngineRows(
        rows, np.asarray(estimate, np.int64), nbytes, _bad_keys(keys, first_row) if keyed else [], keyed
    )


def _bad_keys(keys: pa.Array, first_row: int) -> list[BadRow]:
    suspect = pc.match_substring_regex(keys, _SUSPECT_KEY)
    if not pc.any(suspect).as_py():
        return []
    bad = []
    for index in np.flatnonzero(suspect.to_numpy(zero_copy_only=False)):
        key = keys[int(index)].as_py()
        try:
            check_key(key)
        except WriteError as exc:
            bad.append(BadRow(int(index), first_row + int(index), key, exc.reason))
    return bad


class EngineShardWriter(ShardWriter):
    """``ShardWriter`` that also takes an engine's rows as Arrow (``write_rows``): the same
    shards, roll-over and record batches as ``write`` of each row as a sample."""

    def write_rows(self, rows: EngineRows, start: int, stop: int) -> None:
        """Write rows ``start..stop-1`` of ``rows`` (none of them bad)."""
        i = start
        checked = False  # row i already passed the roll-over check (a first batch closed before it)
        while i < stop:
            cur = self._current
            if cur is None:
                cur = self._current = self._open_next()
            assert isinstance(cur, ArrowShardWriter)
            per = cur.rows_per_batch
            pending = cur.pending_rows
            # the next record batch closes within this many rows: no rule can fire past them
            w = min(stop - i, max(1, (per or BATCH_ROWS) - pending))
            size = rows.nbytes[i : i + w]
            after = cur.pending_bytes + np.cumsum(size)  # pending bytes after each row
            before = after - size
            count = cur.samples + np.arange(w)  # the shard's rows before each row
            roll = (count > 0) & (
                cur.file_bytes + before + rows.estimate[i : i + w] + ROLL_SLACK > self.max_bytes
            )
            if self.max_samples is not None:
                roll |= count >= self.max_samples
            if checked:
                roll[0] = False
            waiting = pending + np.arange(w)  # rows waiting before each row
            if per is None:
                early = (waiting > 0) & (after > BATCH_BYTES)  # the row does not fit the first batch
                full = (after >= BATCH_BYTES) | (waiting + 1 >= BATCH_ROWS)
            else:
                early = np.zeros(w, bool)
                full = waiting + 1 >= per
            j_roll, j_early, j_full = _first(roll), _first(early), _first(full)
            j = min(j_roll, j_early, j_full)
            if j == w:  # no rule fires: all of them join the batch in progress
                self._append(cur, rows, i, i + w, before)
                i, checked = i + w, False
            elif j == j_roll:
                self._append(cur, rows, i, i + j, before)
                self._finish_current()
                i, checked = i + j, False
            elif j == j_early:
                self._append(cur, rows, i, i + j, before)
                cur.flush()
                i, checked = i + j, True
            else:
                self._append(cur, rows, i, i + j + 1, before)
                cur.flush()
                i, checked = i + j + 1, False

    def _append(
        self, cur: ArrowShardWriter, rows: EngineRows, start: int, stop: int, before: np.ndarray
    ) -> None:
        if stop <= start:
            return
        n = stop - start
        offsets = cur.file_bytes + before[:n] if rows.keyed else None
        cur.append_rows(rows.rows.slice(start, n), int(rows.nbytes[start:stop].sum()), offsets)

    def check_keys(self) -> None:
        """Raise for a duplicate key among the shard in progress's rows (before another error
        of a later row is raised: ``write`` would have met the duplicate first)."""
        if isinstance(self._current, ArrowShardWriter):
            self._current.check_keys()


def _first(mask: np.ndarray) -> int:
    """Index of the first True, or ``len(mask)``."""
    i = int(np.argmax(mask)) if len(mask) else 0
    return i if len(mask) and mask[i] else len(mask)


def record_batches(batches: Iterable[Any]) -> Iterator[pa.RecordBatch]:
    """Record batches of batches or tables (a Ray block is a table)."""
    for item in batches:
        if isinstance(item, pa.Table):
            yield from item.to_batches()
        else:
            yield item
