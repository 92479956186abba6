"""Arrow shards: Arrow IPC *file* format, one row per sample, one column per field (``__key__``
first), column types kept. Readable by plain ``pyarrow.ipc.open_file`` (and so by Hugging Face
``datasets``) unchanged.

Layout choice: one record batch per row. Random access then needs exactly one batch, and a
remote read of sample ``i`` fetches that batch's metadata and body only (two small ranged reads),
never its neighbours. The cost is ~a few hundred bytes of batch metadata per row, negligible for
image- or document-sized samples; tiny tabular rows pay more.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from stallfree.errors import CorruptShardError, DuplicateKeyError, WriteError
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.naming import check_field, check_key
from stallfree.storage.atomic import AtomicFile, CommitOnExit

KEY = "__key__"


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
        self.info: ShardInfo | None = None

    @property
    def samples(self) -> int:
        return len(self._keys)

    @property
    def bytes(self) -> int:
        return self._file.size

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
        """Append one sample as one record batch; returns the bytes it took."""
        if self.info is not None:
            raise WriteError("shard already closed", shard=self.name)
        if not isinstance(sample, dict):
            raise WriteError(f"a sample must be a dict, got {type(sample).__name__}", shard=self.name)
        key = check_key(sample.get(KEY))
        if self.schema is None:
            self.schema = infer_schema(sample)
        schema = self.schema
        extra = [n for n in sample if not n.startswith("_") and schema.get_field_index(n) < 0]
        if extra:
            raise WriteError(
                f"fields {extra} are not in the shard's columns {self.fields} (all samples of an Arrow "
                f"dataset share one schema; the first sample sets it)",
                shard=self.name,
                key=key,
            )
        if key in self._keys:
            raise DuplicateKeyError(
                "duplicate sample key in shard", shard=self.name, key=key, offset=self.bytes
            )
        columns = [pa.array([key], pa.string())]
        for f in schema:
            if f.name != KEY:
                columns.append(_column(sample.get(f.name), f.type, f.name, key))
        batch = pa.RecordBatch.from_arrays(columns, schema=schema)
        start = self.bytes
        try:
            if self._writer is None:
                self._writer = pa.ipc.new_file(_Sink(self._file), schema)
            self._writer.write_batch(batch)
        except (pa.ArrowException, OSError) as exc:
            self._file.abort()
            raise WriteError(f"cannot write Arrow batch: {exc}", shard=self.name, key=key) from exc
        self._keys.add(key)
        return self.bytes - start

    def write_prepared(self, prepared: PreparedRow) -> int:
        return self.write(prepared.sample)

    def close(self) -> ShardInfo:
        if self.info is not None:
            return self.info
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
            self.name, len(self._keys), self._file.size, self._file.sha256(), xxh3_128=self._file.xxh3_128()
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
