"""Arrow shards: Arrow IPC *file* format, one row per sample, one column per field (``__key__``
first), column types kept. Readable by plain ``pyarrow.ipc.open_file`` (and so by Hugging Face
``datasets``) unchanged.

Layout choice: small rows are grouped into record batches; a shard's batches all hold the same
number of rows (the last one fewer), recorded in the schema's metadata (``ROWS_PER_BATCH``). The
first batch sets that number: it closes at ``BATCH_BYTES`` of row data or ``BATCH_ROWS`` rows, and
a row of ``BATCH_BYTES`` or more is a batch of its own (so shards of images or documents keep one
row per batch, and their read cost). Why group: a record batch carries a few hundred bytes of
metadata (its message header, per-column buffer descriptions, a footer block) and costs pyarrow a
per-batch write; one batch per row made a ~100-byte tabular row take ~535 bytes on disk and write
~2x slower than MDS (now ~160 bytes). Why the same count in every batch: the IPC footer lists
batches but not their row counts, so a reader of batches of varying size must read every batch
to find a row (remotely, the whole shard at each open); with one count in the schema a row's
batch is ``row // count`` and opening reads the footer only. Random access reads exactly one
batch, up to ``BATCH_ROWS`` rows: rows that grow after the first batch make bigger batches (the
price of the fixed count). The layout depends only on the rows' sizes, so the bytes are the same
for any worker count or engine.

Rows are buffered until their batch closes and converted column by column (not cell by cell):
a value that does not fit its column is therefore reported when its batch is written (by a
later ``write`` or by ``close``), still naming its own sample key and field.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stallfree.errors import CorruptShardError, DuplicateKeyError, WriteError
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.naming import check_field, check_key
from stallfree.storage.atomic import AtomicFile, CommitOnExit

KEY = "__key__"
BATCH_BYTES = 64 * 1024  # row data that closes a shard's first record batch (a bigger row: alone)
BATCH_ROWS = 1024  # rows per record batch at most (tiny rows: bounded work to decode one batch)
# schema metadata key: the rows each record batch holds (the last one fewer); see the docstring
ROWS_PER_BATCH = b"stallfree.rows_per_batch"


def infer_type(value: Any, field: str, key: str) -> pa.DataType:
    """Arrow type for a field from its first value."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return pa.binary()
    if isinstance(value, str):
        return pa.string()
    if isinstance(value, (bool, np.bool_)):
        return pa.bool_()
    if isinstance(value, (int, np.integer)):
        return pa.int64() if isinstance(value, int) else pa.from_numpy_dtype(value.dtype)
    if isinstance(value, (float, np.floating)):
        return pa.float64() if isinstance(value, float) else pa.from_numpy_dtype(value.dtype)
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype == object:
            raise WriteError(
                f"field {field!r}: Arrow shards store 1-D numeric arrays; got shape {value.shape} "
                f"dtype {value.dtype} (flatten it, or use a tar shard with .npy)",
                key=key,
            )
        return pa.list_(pa.from_numpy_dtype(value.dtype))
    try:
        return pa.array([value]).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        raise WriteError(
            f"field {field!r}: cannot store a {type(value).__name__} in Arrow: {exc}", key=key
        ) from None


def infer_schema(sample: dict[str, Any]) -> pa.Schema:
    key = check_key(sample.get(KEY))
    fields = [pa.field(KEY, pa.string(), nullable=False)]
    for name in sorted(sample):
        if name.startswith("_"):
            continue
        check_field(name, key)
        fields.append(pa.field(name, infer_type(sample[name], name, key)))
    if len(fields) == 1:
        raise WriteError("sample has no fields besides '__key__'", key=key)
    return pa.schema(fields)


def _column(value: Any, typ: pa.DataType, field: str, key: str) -> pa.Array:
    try:
        if value is None:
            return pa.nulls(1, typ)
        if isinstance(value, np.ndarray) and pa.types.is_list(typ):
            flat = pa.array(np.ascontiguousarray(value), type=typ.value_type)
            return pa.ListArray.from_arrays(pa.array([0, len(flat)], pa.int32()), flat, type=typ)
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        return pa.array([value], type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        raise WriteError(
            f"field {field!r}: value does not fit the shard's column type {typ}: {exc}", key=key
        ) from None


def value_nbytes(value: Any) -> int:
    """A value's data bytes as the batching rule counts them: bytes/str lengths, array payloads,
    8 for any other value. A row's size is the sum over its key and fields; the batch layout
    follows from these sizes only (deterministic)."""
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, np.ndarray):
        return value.nbytes
    return 8


def _batch_column(values: list[Any], keys: list[str], typ: pa.DataType, field: str) -> pa.Array:
    """One column of a batch, converted at once; a value that does not fit is found again row by
    row so the error names its sample key (as writing it alone would)."""
    try:
        if pa.types.is_list(typ) and any(isinstance(v, np.ndarray) for v in values):
            return _array_list_column(values, typ, field, keys)
        return pa.array(values, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        for value, key in zip(values, keys, strict=True):
            _column(value, typ, field, key)  # raises for the first value that does not fit
        raise WriteError(f"field {field!r}: column of {len(values)} rows does not convert: {exc}") from None


def _array_list_column(values: list[Any], typ: pa.DataType, field: str, keys: list[str]) -> pa.Array:
    """A list column of 1-D numpy arrays (token ids, embeddings): one flat array and offsets,
    cast as each array alone would be (a truncating float->int cast is an error)."""
    dtypes = {v.dtype for v in values if isinstance(v, np.ndarray)}
    if len(dtypes) != 1 or not all(v is None or (isinstance(v, np.ndarray) and v.ndim == 1) for v in values):
        return pa.concat_arrays([_column(v, typ, field, k) for v, k in zip(values, keys, strict=True)])
    lengths = np.fromiter((0 if v is None else len(v) for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise OverflowError(f"{offsets[-1]} list items do not fit 32-bit list offsets")
    parts = [np.ravel(v) for v in values if v is not None]
    flat = pa.array(np.concatenate(parts) if parts else np.array([], next(iter(dtypes))), type=typ.value_type)
    mask = pa.array([v is None for v in values]) if any(v is None for v in values) else None
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat, type=typ, mask=mask)


def _concat_rows(parts: list[pa.RecordBatch], schema: pa.Schema) -> pa.RecordBatch:
    """Rows appended in parts (slices of an engine's batches, rows converted from Python) as one
    record batch with the bytes ``pa.array`` of their Python values gives: concatenated into
    fresh buffers (no bits left over past a bitmap's end), and a column whose nulls hold data
    (an engine may leave any bytes under a null) rebuilt from its values."""
    columns = [
        _canonical(pa.concat_arrays([p.column(i) for p in parts]), field.type)
        for i, field in enumerate(schema)
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _canonical(column: pa.Array, typ: pa.DataType) -> pa.Array:
    if not column.null_count:
        return column
    if len(column.buffers()) < 2 or column.buffers()[1] is None:
        return pa.array(column.to_pylist(), typ)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    if pa.types.is_string(typ) or pa.types.is_binary(typ):
        offsets = np.frombuffer(column.buffers()[1], np.int32, len(column) + 1, column.offset * 4)
        clean = not np.diff(offsets)[~valid].any()
    elif pa.types.is_large_string(typ) or pa.types.is_large_binary(typ):
        offsets = np.frombuffer(column.buffers()[1], np.int64, len(column) + 1, column.offset * 8)
        clean = not np.diff(offsets)[~valid].any()
    elif pa.types.is_boolean(typ):
        bits = np.unpackbits(np.frombuffer(column.buffers()[1], np.uint8), bitorder="little")
        clean = not bits[column.offset : column.offset + len(column)][~valid].any()
    elif pa.types.is_integer(typ) or pa.types.is_floating(typ):
        width = typ.bit_width // 8
        raw = np.frombuffer(column.buffers()[1], np.uint8, len(column) * width, column.offset * width)
        clean = not raw.reshape(len(column), width)[~valid].any()
    else:
        clean = False
    return column if clean else pa.array(column.to_pylist(), typ)


class _Sink:
    """File-like view of an AtomicFile for pyarrow (hashes and counts as pyarrow writes)."""

    def __init__(self, file: AtomicFile) -> None:
        self._file = file
        self.closed = False

    def write(self, data) -> int:
        self._file.write(data)
        return len(data)

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self._file.size

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True


@dataclass(frozen=True)
class PreparedRow:
    """A sample for ``ArrowShardWriter.write_prepared``: checked as it is written; ``nbytes`` is
    ``ArrowShardWriter.estimate``'s guess (0 for what is not a dict: the write says why)."""

    sample: Any
    nbytes: int


def prepare_row(sample: Any) -> PreparedRow:
    return PreparedRow(sample, ArrowShardWriter.estimate(sample) if isinstance(sample, dict) else 0)


class ArrowShardWriter(CommitOnExit):
    """Writes one Arrow IPC file under a temp name, renamed into place on ``close``.

    ``schema``: fix the column types (e.g. a Parquet source's own schema, ``__key__`` column
    added if absent); otherwise they are inferred from the first sample. Later samples may omit a
    field (null) but not add one.
    """

    suffix = ".arrow"

    def __init__(
        self,
        path: str,
        fs: fsspec.AbstractFileSystem | None = None,
        *,
        schema: pa.Schema | None = None,
        **storage_options: Any,
    ) -> None:
        if fs is None:
            fs, path = fsspec.core.url_to_fs(path, **storage_options)
        self.fs = fs
        self.path = path
        self.name = posixpath.basename(path)
        if schema is not None and schema.get_field_index(KEY) < 0:
            schema = pa.schema([pa.field(KEY, pa.string(), nullable=False), *schema])
        self.schema: pa.Schema | None = schema
        self._file = AtomicFile(fs, path, shard=self.name)
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._keys: set[str] = set()
        # the batch in progress, column by column: its keys, then each field's values in
        # ``_names`` order; ``_pending_bytes``: their data bytes (``value_nbytes``)
        self._names: tuple[str, ...] = ()
        self._known: frozenset[str] = frozenset()
        self._pending_keys: list[str] = []
        self._pending: list[list[Any]] = []
        self._pending_bytes = 0
        # rows appended as Arrow (``append_rows``): slices in the shard's schema, before the
        # Python rows above, and their keys with the shard's size before each (a duplicate is
        # found by one hash pass at ``close``, reported as ``write`` would have)
        self._parts: list[pa.RecordBatch] = []
        self._pending_count = 0  # rows waiting for their batch, both kinds
        self._rows = 0
        self._key_chunks: list[tuple[pa.Array, np.ndarray]] = []
        self.batches = 0  # record batches written so far
        self._per_batch: int | None = None  # rows of every batch, set by the first one
        self.info: ShardInfo | None = None

    @property
    def samples(self) -> int:
        return self._rows

    @property
    def pending_rows(self) -> int:
        """Rows waiting for their record batch."""
        return self._pending_count

    @property
    def pending_bytes(self) -> int:
        """Their data bytes as the batching rule counts them (``value_nbytes``)."""
        return self._pending_bytes

    @property
    def file_bytes(self) -> int:
        """Bytes of the shard file written so far (record batches written, header)."""
        return self._file.size

    @property
    def rows_per_batch(self) -> int | None:
        """Rows of every record batch of this shard; None until the first one is written."""
        return self._per_batch

    @property
    def bytes(self) -> int:
        """Bytes written, plus the data of rows waiting for their batch (for shard roll-over)."""
        return self._file.size + self._pending_bytes

    @property
    def fields(self) -> list[str]:
        return [] if self.schema is None else [n for n in self.schema.names if n != KEY]

    @property
    def field_types(self) -> dict[str, str] | None:
        """Each field's Arrow type as the manifest records it (None before the schema is known)."""
        return None if self.schema is None else {f.name: str(f.type) for f in self.schema if f.name != KEY}

    @staticmethod
    def estimate(sample: dict[str, Any]) -> int:
        """Rough bytes a sample adds (its payload plus per-batch metadata), for shard roll-over."""
        total = 256
        for name, value in sample.items():
            if isinstance(value, (bytes, bytearray, memoryview, str)):
                total += len(value) + 16
            elif isinstance(value, np.ndarray):
                total += value.nbytes + 16
            else:
                total += 16
            total += 64 + len(name)
        return total

    def write(self, sample: dict[str, Any]) -> int:
        """Add one sample to the batch in progress (written when it fills, or by ``close``);
        returns the bytes ``bytes`` grew by."""
        if self.info is not None:
            raise WriteError("shard already closed", shard=self.name)
        if not isinstance(sample, dict):
            raise WriteError(f"a sample must be a dict, got {type(sample).__name__}", shard=self.name)
        key = check_key(sample.get(KEY))
        if self.schema is None:
            self.schema = infer_schema(sample)
        if not self._known:
            self._names = tuple(n for n in self.schema.names if n != KEY)
            self._known = frozenset(self.schema.names)
            self._pending = [[] for _ in self._names]
        extra = [n for n in sample if n not in self._known and not n.startswith("_")]
        if extra:
            raise WriteError(
                f"fields {extra} are not in the shard's columns {self.fields} (all samples of an Arrow "
                f"dataset share one schema; the first sample sets it)",
                shard=self.name,
                key=key,
            )
        if self._key_chunks:
            self._settle_arrow_keys()
        if key in self._keys:
            raise DuplicateKeyError(
                "duplicate sample key in shard", shard=self.name, key=key, offset=self.bytes
            )
        values = [sample.get(name) for name in self._names]
        size = len(key)
        for i, value in enumerate(values):
            if isinstance(value, (bytes, str)):
                size += len(value)
            elif isinstance(value, (bytearray, memoryview)):
                values[i] = value = bytes(value)
                size += len(value)
            else:
                size += value_nbytes(value)
        start = self.bytes
        per = self._per_batch
        if per is None and self._pending_count and self._pending_bytes + size > BATCH_BYTES:
            self._flush()  # the row does not fit the first batch: that batch's count is set
            per = self._per_batch
        self._keys.add(key)
        self._rows += 1
        self._pending_keys.append(key)
        for column, value in zip(self._pending, values, strict=True):
            column.append(value)
        self._pending_bytes += size
        self._pending_count += 1
        if per is not None:
            if self._pending_count >= per:
                self._flush()
        elif self._pending_bytes >= BATCH_BYTES or self._pending_count >= BATCH_ROWS:
            self._flush()
        return self.bytes - start

    def append_rows(self, rows: pa.RecordBatch, nbytes: int, offsets: np.ndarray | None) -> None:
        """Add rows already in the shard's schema (``__key__`` checked, no nulls) to the batch in
        progress, as ``write`` would one by one, without Python values: the engine's Arrow path
        (``arrow/engine_rows.py``), which applies the batching rule and calls ``flush`` where
        ``write`` would. ``nbytes``: their data bytes (``value_nbytes``); ``offsets``: ``bytes``
        before each row, to name a duplicate key's place (None: keys unique by construction)."""
        if self.info is not None:
            raise WriteError("shard already closed", shard=self.name)
        if self.schema is None:
            self.schema = rows.schema
        if not self._known:
            self._names = tuple(n for n in self.schema.names if n != KEY)
            self._known = frozenset(self.schema.names)
            self._pending = [[] for _ in self._names]
        if self._pending_keys:  # rows written one by one first keep their place
            self._parts.append(self._python_rows())
        self._parts.append(rows)
        if offsets is not None:
            self._key_chunks.append((rows.column(KEY), offsets))
        self._rows += rows.num_rows
        self._pending_count += rows.num_rows
        self._pending_bytes += nbytes

    def flush(self) -> None:
        """Write the rows waiting as one record batch (``append_rows``' caller, at the rule's
        points)."""
        self._flush()

    def check_keys(self) -> None:
        """Raise ``DuplicateKeyError`` for the first row appended by ``append_rows`` whose key an
        earlier row of this shard has, naming it and its offset as ``write`` would have."""
        if not self._key_chunks:
            return
        keys = pa.concat_arrays([k for k, _ in self._key_chunks])
        if pc.count_distinct(keys).as_py() == len(keys) and not (
            self._keys and pc.any(pc.is_in(keys, value_set=pa.array(list(self._keys), pa.string()))).as_py()
        ):
            return
        offsets = np.concatenate([o for _, o in self._key_chunks])
        seen = set(self._keys)
        for row, key in enumerate(keys.to_pylist()):  # only when there is one: find it in order
            if key in seen:
                self._file.abort()
                raise DuplicateKeyError(
                    "duplicate sample key in shard", shard=self.name, key=key, offset=int(offsets[row])
                )
            seen.add(key)

    def _settle_arrow_keys(self) -> None:
        """Before a row written one by one: the Arrow rows' keys checked and kept in ``_keys``."""
        self.check_keys()
        for keys, _ in self._key_chunks:
            self._keys.update(keys.to_pylist())
        self._key_chunks = []

    def _python_rows(self) -> pa.RecordBatch:
        """The rows written one by one and waiting, as a record batch (taken from pending)."""
        keys, pending = self._pending_keys, self._pending
        self._pending_keys, self._pending = [], [[] for _ in self._names]
        by_name = dict(zip(self._names, pending, strict=True))
        try:
            columns = [
                pa.array(keys, pa.string())
                if f.name == KEY
                else _batch_column(by_name[f.name], keys, f.type, f.name)
                for f in self.schema
            ]
            return pa.RecordBatch.from_arrays(columns, schema=self.schema)
        except WriteError as exc:
            self._file.abort()
            raise WriteError(exc.reason, shard=self.name, key=exc.key) from None

    def _flush(self) -> None:
        """Write the pending rows as one record batch (converted column by column)."""
        if not self._pending_count:
            return
        parts = self._parts
        if len(parts) == 0:  # only rows written one by one: converted here, as always
            batch = self._python_rows()
        else:
            if self._pending_keys:
                parts.append(self._python_rows())
            batch = _concat_rows(parts, self.schema)
        self._parts, self._pending_count, self._pending_bytes = [], 0, 0
        schema = self.schema
        try:
            if self._writer is None:
                self._per_batch = batch.num_rows
                meta = {**(schema.metadata or {}), ROWS_PER_BATCH: str(batch.num_rows).encode()}
                self._writer = pa.ipc.new_file(_Sink(self._file), schema.with_metadata(meta))
            self._writer.write_batch(batch)
        except (pa.ArrowException, OSError) as exc:
            self._file.abort()
            keys = batch.column(KEY)
            first, last = keys[0].as_py(), keys[-1].as_py()
            raise WriteError(
                f"cannot write Arrow batch of rows {first!r}..{last!r}: {exc}", shard=self.name, key=first
            ) from exc
        self.batches += 1

    def write_prepared(self, prepared: PreparedRow) -> int:
        return self.write(prepared.sample)

    def close(self) -> ShardInfo:
        if self.info is not None:
            return self.info
        self.check_keys()
        self._flush()
        if self._writer is None:
            if self.schema is None:
                self._file.abort()
                raise WriteError("an Arrow shard needs a schema or at least one sample", shard=self.name)
            self._writer = pa.ipc.new_file(_Sink(self._file), self.schema)
        try:
            self._writer.close()
        except BaseException:
            self._file.abort()
            raise
        self._file.commit()
        self.info = ShardInfo(
            self.name, self._rows, self._file.size, self._file.sha256(), xxh3_128=self._file.xxh3_128()
        )
        return self.info

    def abort(self) -> None:
        self._file.abort()


def _is_numeric_list(t: pa.DataType) -> bool:
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    vt = t.value_type
    return pa.types.is_integer(vt) or pa.types.is_floating(vt) or pa.types.is_boolean(vt)


def row_converter(schema: pa.Schema, shard: str):
    """``(batch, row, shard_row=None) -> sample dict`` for one schema: binary -> bytes, numeric lists
    -> np.ndarray, the rest -> Python values. ``shard_row`` (the row's number in the whole shard,
    default ``row``) names the row in errors and in the key made for files without ``__key__``.
    Built once per shard so the per-row work is one pass over columns."""
    names = list(schema.names)
    arrays = {j for j, f in enumerate(schema) if _is_numeric_list(f.type)}
    has_key = KEY in names
    stem = posixpath.splitext(shard)[0]

    def convert(batch: pa.RecordBatch, row: int, shard_row: int | None = None) -> dict[str, Any]:
        at = row if shard_row is None else shard_row
        try:
            if arrays:
                values = []
                for j, col in enumerate(batch.columns):
                    v = col[row]
                    if j in arrays and v.is_valid:
                        values.append(v.values.to_numpy(zero_copy_only=False))
                    else:
                        values.append(v.as_py())
            else:
                values = [col[row].as_py() for col in batch.columns]
        except (pa.ArrowException, IndexError) as exc:
            raise CorruptShardError(f"cannot decode Arrow row {at}: {exc}", shard=shard) from exc
        out = dict(zip(names, values, strict=True))
        if not has_key:
            out[KEY] = f"{stem}/{at}"
        return out

    return convert
