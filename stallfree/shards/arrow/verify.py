"""Verify one Arrow shard (IPC file, IPC stream or Parquet): open, validate every record batch,
count rows and collect keys; ``decode=True`` decodes image fields too."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from typing import IO, Any

import fsspec

from stallfree.errors import (
    CorruptShardError,
    DuplicateKeyError,
    IndexMismatchError,
)
from stallfree.shards.arrow.reader import open_batches
from stallfree.shards.fields import is_image_field
from stallfree.shards.manifest.model import ShardInfo
from stallfree.shards.scan import SHARD_MISSING, record_mismatches
from stallfree.shards.verify import HashingReader, decode_image
from stallfree.shards.verify_report import KeyAt, ProgressFn, VerifyReport
from stallfree.storage.fs import file_size, open_read

_LAYOUTS = {"_IpcFile": "Arrow IPC file", "_IpcStream": "Arrow IPC stream", "_ParquetGroups": "Parquet file"}


def _table_batches(f: IO[bytes], path: str, shard: str) -> tuple[Iterator[Any], str, Any]:
    """The record batches of a table shard, front to back, opened by the readers' one opener
    (``arrow.reader.open_batches``: the same layouts, checks and messages), with the layout's
    name for messages and the opened table (a stream's ``damage``: where its walk stopped)."""
    import pyarrow as pa

    source = pa.PythonFile(f, mode="r")
    tables = open_batches(
        source, path, shard, False, lambda start, end: source.read_at(end - start, start), partial=True
    )
    layout = _LAYOUTS.get(type(tables).__name__, "Arrow IPC file")
    return (tables.get_batch(b) for b in range(tables.num_record_batches)), layout, tables


def verify_arrow_shard(
    fs: fsspec.AbstractFileSystem,
    path: str,
    info: ShardInfo,
    report: VerifyReport,
    *,
    hashes: bool = True,
    decode: bool = False,
    progress: ProgressFn | None = None,
) -> list[KeyAt]:
    """Check one table shard (Arrow IPC file or stream, or Parquet: ``_table_batches``), adding
    problems to ``report``; returns its rows' keys (as the dataset yields them: ``stem/row`` where
    the file has no ``__key__`` column) for the cross-shard check."""
    import pyarrow as pa

    shard = info.path
    errors = report.errors
    size = file_size(fs, path, shard=shard, missing=SHARD_MISSING)
    with open_read(fs, path, size, shard=shard, block_size=1 << 22) as f:  # checked reads
        reader = HashingReader(f, 0, progress)
        reader.read_rest()
    report.bytes += reader.pos
    errors.extend(record_mismatches(info, reader.pos, reader.sha.hexdigest() if hashes else None))
    stem = posixpath.splitext(shard)[0]
    found: list[KeyAt] = []  # as the dataset yields them; rows with a null key have none
    layout = "Parquet file" if path.endswith(".parquet") else "Arrow IPC file"
    b = -1
    try:
        # read ahead: batches are read front to back (a stream twice: walked, then each batch)
        with open_read(fs, path, size, shard=shard, block_size=1 << 22) as f:
            batches, layout, tables = _table_batches(f, path, shard)
            rows = 0
            seen: set[str] = set()
            for b, batch in enumerate(batches):
                try:
                    batch.validate(full=True)
                except Exception as exc:  # noqa: BLE001 - pyarrow's validation errors vary by version
                    errors.append(CorruptShardError(f"record batch {b} is invalid: {exc}", shard=shard))
                    continue
                has_key = "__key__" in batch.schema.names
                keys = batch.column("__key__").to_pylist() if has_key else [None] * batch.num_rows
                for r, key in enumerate(keys):
                    if key is not None and key in seen:
                        errors.append(
                            DuplicateKeyError("duplicate sample key in shard", shard=shard, key=key)
                        )
                    seen.add(key)
                    if key is not None:
                        found.append((str(key), None))
                    elif not has_key:
                        found.append((f"{stem}/{rows + r}", None))
                    if decode:
                        for name in batch.schema.names:
                            if is_image_field(name):
                                value = batch.column(name)[r].as_py()
                                if isinstance(value, bytes):
                                    report.decoded += 1
                                    problem = decode_image(value, shard, str(key), None, name)
                                    if problem:
                                        errors.append(problem)
                rows += batch.num_rows
            damage = getattr(tables, "damage", None)  # a stream message that did not parse
            if damage is not None:
                what = f"{layout} unreadable after record batch {b}" if b >= 0 else f"not a readable {layout}"
                errors.append(
                    CorruptShardError(f"{what}: {damage.reason}", shard=shard, offset=damage.offset)
                )
                return found
    except CorruptShardError as exc:
        errors.append(exc)
        return found
    except (pa.ArrowException, OSError, ValueError) as exc:
        what = f"{layout} unreadable after record batch {b}" if b >= 0 else f"not a readable {layout}"
        errors.append(CorruptShardError(f"{what}: {exc}", shard=shard))
        return found
    report.samples += rows
    if rows != info.samples:
        errors.append(
            IndexMismatchError(
                f"manifest says {info.samples} samples, the Arrow file holds {rows}", shard=shard
            )
        )
    return found
