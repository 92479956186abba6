"""Shards from an engine's own data (a Spark DataFrame: ``write_spark``; a Ray Dataset:
``write_ray``), the engine-neutral half. The engine glue lives in ``stallfree/engines/``.

Each partition task writes its rows, as Arrow record batches, into shards named for its
partition (``part-00003-0000.tar``: partition 3, its first shard) with ``ShardWriter`` (temp
names renamed into place, rolled at ``max_bytes`` / ``max_samples``), and returns its part of
the manifest as JSON (no pickle). The driver merges the parts in partition order and commits
one manifest: before that commit the destination's old dataset is whole, and a run that fails
removes every file of its own (named by the pattern, in a generation the old dataset does not
use), so a retried or speculative attempt (same partition, same rows, same names, same bytes)
never leaves a duplicate or half shard. Columns become fields: binary columns are written as
their bytes, strings as UTF-8, numbers as text (tar), or typed columns (Arrow); the key is the
``__key__`` (or ``key``) column, else ``PPPPP-RRRRRRRRR`` (partition, row within it).
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec

from stallfree.errors import DatasetExistsError, WriteError
from stallfree.shards import formats
from stallfree.shards.manifest.model import FORMAT_VERSION, MANIFEST_NAME, Manifest, files_in_use
from stallfree.shards.naming import check_key
from stallfree.shards.parallel import ShardSummary
from stallfree.shards.sources.registry import SourceReadError
from stallfree.shards.writer import ShardWriter
from stallfree.storage.atomic import check_writable, remove_stale_temps

log = logging.getLogger(__name__)

PARTITION_STEM = "part-{partition:05d}-{index:04d}"
# every file a run may write: a partition's shard (any generation) and its sidecars
_RUN_FILE = re.compile(r"^part-\d{5,}-\d{4,}(\.g\d+)?\.[A-Za-z0-9]+$")


@dataclass(frozen=True)
class PartitionWrite:
    """How every partition task writes (sent once to each task): where, which format, the shard
    limits, the error policy for rows that cannot be samples (a key no shard may hold)."""

    dst: str
    storage_options: dict[str, Any]
    format: str = "tar"
    max_bytes: int = 256_000_000
    max_samples: int | None = None
    on_error: str = "raise"

    def __post_init__(self) -> None:
        if self.format not in formats.format_names():
            raise ValueError(f"format must be {formats.choices(quote=True)}, not {self.format!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {self.on_error!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer, got {self.max_bytes!r}")
        if self.max_samples is not None and (
            isinstance(self.max_samples, bool)
            or not isinstance(self.max_samples, int)
            or self.max_samples <= 0
        ):
            raise ValueError(f"max_samples must be a positive integer or None, got {self.max_samples!r}")


@dataclass(frozen=True)
class PartitionPart:
    """What one partition wrote: its index, its part of the manifest (None: no rows), the rows
    it skipped (``on_error="skip"``), or the data error that ended it (``error``: not retried,
    it would fail alike on every attempt)."""

    partition: int
    manifest: Manifest | None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def dumps(self) -> str:
        return json.dumps(
            {
                "partition": self.partition,
                "manifest": None if self.manifest is None else self.manifest.to_json(),
                "skipped": self.skipped,
                "error": self.error,
            }
        )

    @classmethod
    def loads(cls, text: str) -> PartitionPart:
        obj = json.loads(text)
        where = f"partition {obj['partition']}'s result"
        manifest = None if obj["manifest"] is None else Manifest.from_json(obj["manifest"], where=where)
        return cls(int(obj["partition"]), manifest, list(obj["skipped"]), obj.get("error"))


def samples_of(
    batches: Iterable[Any], partition: int, on_error: str, first_row: int = 0
) -> Iterator[dict[str, Any] | SourceReadError]:
    """Arrow record batches (or tables) as samples, in order; a row whose key no shard may hold
    is a ``SourceReadError`` naming partition and row (``on_error`` applies; rows are numbered
    from ``first_row``). The same samples as ``sources.tables.row_sample`` makes of each row,
    converted a column at a time (a dict per row from ``to_pylist`` was a third of a small-row
    partition's time). Arrow shards of the common column types skip the samples altogether:
    ``arrow/engine_rows.py``, byte-identical."""
    row = first_row
    where = f"partition {partition}"
    for batch in batches:
        names = list(batch.schema.names)
        columns = [column.to_pylist() for column in batch.columns]
        keys = columns[names.index("__key__")] if "__key__" in names else None
        alt = columns[names.index("key")] if "key" in names else None
        fields = [(n, c) for n, c in zip(names, columns, strict=True) if n != "__key__"]
        for r in range(batch.num_rows):
            key = keys[r] if keys is not None else None
            if key is None and alt is not None:
                key = alt[r]
            key = str(key) if key is not None else f"{partition:05d}-{row:09d}"
            try:
                check_key(key)
            except WriteError as exc:
                yield SourceReadError(f"row {row}: {exc.reason}", path=where, key=key)
                row += 1
                continue
            sample: dict[str, Any] = {"__key__": key}
            for name, column in fields:
                value = column[r]
                if value is not None:
                    sample[name] = value
            yield sample
            row += 1


def arrow_schema(batch_schema: Any, fmt: str) -> Any:
    """The column types a typed-fields format (Arrow) keeps: the engine's own, ``__key__`` a
    string; None for a format whose fields are bytes."""
    if batch_schema is None or not formats.get_format(fmt).typed_fields:
        return None
    import pyarrow as pa

    schema = batch_schema
    i = schema.get_field_index("__key__")
    if i >= 0:
        schema = schema.set(i, pa.field("__key__", pa.string(), nullable=False))
    return schema.remove_metadata()


def write_partition(
    spec: PartitionWrite,
    partition: int,
    batches: Iterable[Any],
    schema: Any = None,
    *,
    arrow_rows: bool = True,
) -> PartitionPart:
    """Write one partition's rows into its shards (runs in the engine's task). ``schema``: the
    batches' Arrow schema (kept for Arrow shards). Raises on the first bad row with
    ``on_error="raise"``; aborts the shard in progress on any error (finished ones are renamed
    and removed by the driver if the run fails). Arrow shards from batches of the column types
    ``engine_rows`` covers are written without a Python value per row (``arrow_rows=False``:
    every row as a sample, the reference the tests and the benchmark compare bytes with)."""
    writer_class = ShardWriter
    engine_writer = getattr(formats.get_format(spec.format), "engine_writer", None)  # Arrow's
    if engine_writer is not None and schema is not None and arrow_rows:
        writer_class = engine_writer(schema) or ShardWriter
    writer = writer_class(
        spec.dst,
        format=spec.format,
        max_bytes=spec.max_bytes,
        max_samples=spec.max_samples,
        name=PARTITION_STEM.replace("{partition:05d}", f"{partition:05d}"),
        schema=arrow_schema(schema, spec.format),
        write_manifest=False,
        **spec.storage_options,
    )
    skipped: list[dict[str, Any]] = []
    try:
        if writer_class is ShardWriter:
            _write_samples(writer, samples_of(batches, partition, spec.on_error), spec.on_error, skipped)
        else:
            _write_arrow_rows(writer, spec, partition, batches, schema, skipped)
        manifest = writer.close()
    except BaseException:
        writer.abort()
        raise
    return PartitionPart(partition, manifest if manifest.shards else None, skipped)


def _write_samples(
    writer: ShardWriter,
    samples: Iterable[dict[str, Any] | SourceReadError],
    on_error: str,
    skipped: list[dict[str, Any]],
) -> None:
    for sample in samples:
        if isinstance(sample, SourceReadError):
            if on_error == "raise":
                raise sample
            skipped.append(_skipped(sample))
            continue
        writer.write(sample)


def _skipped(error: SourceReadError) -> dict[str, Any]:
    return {"source": error.path, "error": error.reason, "key": error.key}


def _write_arrow_rows(
    writer: Any, spec: PartitionWrite, partition: int, batches: Iterable[Any], schema: Any, skipped: list
) -> None:
    """The batches into Arrow shards as Arrow (``engine_rows``); a batch whose schema is not the
    first's goes row by row (``samples_of``), into the same shards."""
    import pyarrow as pa

    from stallfree.shards.arrow import engine_rows
    from stallfree.shards.arrow.writer import KEY

    shard_schema = arrow_schema(schema, spec.format)
    if shard_schema.get_field_index(KEY) < 0:
        shard_schema = pa.schema([pa.field(KEY, pa.string(), nullable=False), *shard_schema])
    where = f"partition {partition}"
    row = 0
    for batch in engine_rows.record_batches(batches):
        n = batch.num_rows
        if not batch.schema.equals(schema, check_metadata=False):
            _write_samples(writer, samples_of([batch], partition, spec.on_error, row), spec.on_error, skipped)
            row += n
            continue
        if n == 0:
            continue
        rows = engine_rows.prepare_batch(batch, shard_schema, partition, row)
        start = 0
        for bad in rows.bad:
            writer.write_rows(rows, start, bad.index)
            error = SourceReadError(f"row {bad.row}: {bad.reason}", path=where, key=bad.key)
            if spec.on_error == "raise":
                writer.check_keys()  # a duplicate before it is the error row by row would meet first
                raise error
            skipped.append(_skipped(error))
            start = bad.index + 1
        writer.write_rows(rows, start, n)
        row += n


@dataclass
class Destination:
    """The destination as the driver found it: its filesystem and root, the dataset there (if
    any) and the files it uses, which this run must not touch until its manifest is committed."""

    url: str
    fs: fsspec.AbstractFileSystem
    root: str
    old: Manifest | None
    in_use: set[str]


def open_destination(dst: str, *, overwrite: bool, storage_options: dict[str, Any]) -> Destination:
    """Check ``dst`` before any task runs: a dataset there is refused unless ``overwrite``; the
    directory is writable; temp files of killed runs are removed."""
    fs, root = fsspec.core.url_to_fs(dst, **storage_options)
    root = root.rstrip("/") or root
    if fs.exists(posixpath.join(root, MANIFEST_NAME)) and not overwrite:
        raise DatasetExistsError(f"{dst} already holds a dataset ({MANIFEST_NAME})")
    check_writable(fs, root)
    remove_stale_temps(fs, root)
    old, in_use = files_in_use(fs, root)
    return Destination(dst, fs, root, old, in_use)


def first_error(parts: Iterable[PartitionPart]) -> PartitionPart | None:
    """The lowest-numbered partition that ended in a data error, if any."""
    return min((p for p in parts if p.error is not None), key=lambda p: p.partition, default=None)


def commit_parts(
    dest: Destination,
    spec: PartitionWrite,
    parts: Iterable[PartitionPart],
    started: float,
    extra: dict[str, Any],
) -> ShardSummary:
    """Merge the partitions' parts in partition order and commit one manifest (the commit point);
    on failure remove this run's files and leave the old dataset as it was."""
    try:
        ordered = sorted(parts, key=lambda p: p.partition)
        shards, fields, field_types, skipped = [], {}, {}, []
        for part in ordered:
            skipped.extend(part.skipped)
            if part.manifest is None:
                continue
            shards.extend(part.manifest.shards)
            fields.update(dict.fromkeys(part.manifest.fields))
            for name, kind in (part.manifest.field_types or {}).items():
                field_types.setdefault(name, kind)
        if not shards:
            raise WriteError(
                f"no rows to write to {dest.url}" + (f" ({len(skipped)} skipped)" if skipped else "")
            )
        fmt = formats.get_format(spec.format)
        manifest = Manifest(
            version=FORMAT_VERSION,
            format=spec.format,
            fields=list(fields),
            shards=shards,
            classes=None,
            skipped=skipped,
            field_types=field_types if fmt.typed_fields else None,
            checksums=fmt.checksums,
            extra={"shuffle_seed": None, **extra},
        )
        written = manifest.commit(dest.fs, dest.root, replacing=dest.old)
    except BaseException:
        remove_run_files(dest)
        raise
    return ShardSummary(manifest, written, time.perf_counter() - started, skipped)


def remove_run_files(dest: Destination) -> None:
    """Undo a failed run: every partition file in the destination that the old dataset does not
    use (this run's, finished by any attempt, and leftovers of earlier failed runs)."""
    try:
        names = dest.fs.ls(dest.root, detail=False)
    except FileNotFoundError:
        return
    for path in names:
        path = posixpath.normpath(path)
        if not _RUN_FILE.match(posixpath.basename(path)) or path in dest.in_use:
            continue
        try:
            dest.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("could not remove %s after a failed run: %s", path, exc)
