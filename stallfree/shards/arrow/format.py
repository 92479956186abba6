"""The Arrow shard format: one table file per shard, one row per sample, column types kept
(``field_types`` in the manifest). Written as Arrow IPC files (``arrow.py``); read, and opened
without a manifest, also as Arrow IPC streams (Hugging Face ``save_to_disk``) and Parquet
(``arrow.reader.ArrowShardReader``; verified by ``arrow.verify.verify_arrow_shard``). This file is what the
registry (``formats.py``) knows of them, and how table files without a manifest are described."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import fsspec

from stallfree.errors import ShardError
from stallfree.shards.arrow.hf import columns_of_schema
from stallfree.shards.arrow.reader import ArrowShardReader
from stallfree.shards.arrow.verify import verify_arrow_shard
from stallfree.shards.formats import ScannedFiles, ShardCheck, ShardOpen
from stallfree.shards.manifest.shard_info import ShardInfo
from stallfree.shards.scan import relative
from stallfree.shards.verify_report import KeyAt, VerifyReport
from stallfree.storage import stamps

log = logging.getLogger(__name__)

SAMPLE_OVERHEAD = 256  # planning estimates: a record batch's metadata per sample ...
FIELD_OVERHEAD = 96  # ... and per column


class ArrowFormat:
    """Arrow shards: no sidecars, no per-member checksums (the sha256 covers the file), typed
    fields; a dataset of table files gets a manifest by re-sharding (``stallfree shard``)."""

    name = "arrow"
    suffix = ".arrow"
    # Table files opened without a manifest: Arrow IPC file or stream (Hugging Face
    # ``save_to_disk`` writes the stream format under .arrow), Parquet (Hugging Face's exports).
    scan_suffixes = (".arrow", ".parquet")
    shard_overhead = 0
    checksums = None
    typed_fields = True
    indexable = False

    def sidecars(self, path: str, with_checksums: bool = True) -> list[str]:
        return []

    def item_cost(self, sizes: Sequence[int]) -> int:
        return SAMPLE_OVERHEAD + sum(s + FIELD_OVERHEAD for s in sizes)

    _prepare_row: Any = None  # ``arrow.writer.prepare_row`` once the first sample is written

    def prepare(self, sample: dict[str, Any]) -> Any:
        prepare_row = self._prepare_row
        if prepare_row is None:  # pyarrow: imported only to write Arrow, then kept (an import
            # statement per row was ~8% of writing a small row)
            from stallfree.shards.arrow.writer import prepare_row

            self._prepare_row = prepare_row
        return prepare_row(sample)

    def engine_writer(self, schema: Any) -> Any:
        """The ``ShardWriter`` class that writes an engine's Arrow batches of ``schema`` without a
        Python value per row (``arrow/engine_rows.py``: ``write_spark``, ``write_ray``), or None
        where its column types need the rows one by one (the reason is logged)."""
        from stallfree.shards.arrow import engine_rows

        why = engine_rows.unsupported(schema)
        if why is not None:
            log.debug("engine batches written row by row: %s", why)
            return None
        return engine_rows.EngineShardWriter

    def writer(
        self, path: str, fs: fsspec.AbstractFileSystem, *, schema: Any = None, overlap_hash: bool = False
    ) -> Any:
        from stallfree.shards.arrow.writer import ArrowShardWriter

        return ArrowShardWriter(path, fs=fs, schema=schema)

    def source_schema(self, source: Any) -> Any:
        """A table source's own Arrow schema (types kept), with ``__key__`` as a string column;
        for a dataset read through ``open_dataset`` in the Arrow format, its first shard's (so
        re-sharding keeps an ``int16`` column ``int16``, not one inferred again from values)."""
        getter = getattr(source, "schema", None)
        schema = getter() if callable(getter) else _dataset_schema(source)
        if schema is None:
            return None
        import pyarrow as pa

        i = schema.get_field_index("__key__")
        if i >= 0:
            schema = schema.set(i, pa.field("__key__", pa.string(), nullable=False))
        return schema.remove_metadata()

    def open_reader(self, request: ShardOpen) -> ArrowShardReader:
        info = request.info
        return ArrowShardReader(request.fs, request.path, info.path, info, request.verify_hash)

    def verify(self, check: ShardCheck, report: VerifyReport) -> list[KeyAt]:
        return verify_arrow_shard(
            check.fs,
            check.path,
            check.info,
            report,
            hashes=check.hashes,
            decode=check.decode,
            progress=check.progress,
        )

    def scan(self, fs: fsspec.AbstractFileSystem, root: str, paths: list[str]) -> ScannedFiles:
        """Table files as shards: rows counted and schemas compared as each opens, each stamped
        with the store's version of it and its schema (so the fingerprint follows content);
        Hugging Face ``ClassLabel`` names become the classes."""
        shards, fields, unversioned = [], {}, []
        first: tuple[str, Any] | None = None
        for path in paths:
            rel = relative(root, path)
            reader = ArrowShardReader(fs, path, rel)
            reader.close()  # what is needed was read when it opened
            size, version = stamps.store_version(fs, path, rel)
            if version is None:
                unversioned.append(rel)
            if first is None:
                first = (rel, reader.schema)
            else:
                _check_same_schema(first, (rel, reader.schema))
            for name in reader.schema.names:
                if name != "__key__":
                    fields.setdefault(name, None)
            mark = stamps.stamp(size, version, str(reader.schema))
            shards.append(ShardInfo(rel, reader.rows, reader.size, None, stamp=mark))
        stamps.warn_unversioned(fs.unstrip_protocol(root or "/"), unversioned)
        columns = columns_of_schema(first[1]) if first is not None else None
        extra = {"class_field": columns.class_field} if columns is not None and columns.class_field else {}
        classes = columns.classes if columns is not None else None
        return ScannedFiles(shards, list(fields), None, classes=classes, extra=extra)


def _dataset_schema(source: Any) -> Any:
    """The schema rows of an Arrow-format ``ShardedDataset`` source come out with (media
    columns of a Hugging Face table as the bytes its reader gives), or None for another source."""
    dataset = getattr(source, "dataset", None)
    manifest = getattr(dataset, "manifest", None)
    if manifest is None or manifest.format != "arrow" or not manifest.shards:
        return None
    from stallfree.shards.arrow.hf import binary_schema

    info = manifest.shards[0]
    reader = ArrowShardReader(dataset.fs, dataset.shard_path(0), info.path, info)
    try:
        schema = reader.schema
    finally:
        reader.close()
    return binary_schema(schema, columns_of_schema(schema))


def schema_differences(a: Any, b: Any, name_a: str, name_b: str) -> list[str]:
    """How two Arrow schemas differ, field by field (order and metadata aside): fields only one
    has, and fields whose types differ. Empty when they agree. ``__key__`` is not a field: a
    file without it gets ``stem/row`` keys, so files with and without it mix."""
    types_a = {f.name: f.type for f in a if f.name != "__key__"}
    types_b = {f.name: f.type for f in b if f.name != "__key__"}
    found = []
    for name, t in types_a.items():
        if name not in types_b:
            found.append(f"{name!r} only in {name_a}")
        elif types_b[name] != t:
            found.append(f"{name!r} is {t} in {name_a} but {types_b[name]} in {name_b}")
    found += [f"{name!r} only in {name_b}" for name in types_b if name not in types_a]
    return found


def _check_same_schema(first: tuple[str, Any], other: tuple[str, Any]) -> None:
    """Table files read as one dataset must share one schema, as pyarrow's datasets and Hugging
    Face ``datasets`` require: a glob over different tables used to open silently as one, with
    each sample's fields depending on the file it came from."""
    (name_a, a), (name_b, b) = first, other
    found = schema_differences(a, b, name_a, name_b)
    if found:
        shown = "; ".join(found[:6]) + (f"; and {len(found) - 6} more" if len(found) > 6 else "")
        raise ShardError(
            f"{name_a} and {name_b} have different schemas ({shown}): the table files of one dataset "
            "must share one schema (open each kind separately, or mix them with stallfree.mix)",
            shard=name_b,
        )


ARROW = ArrowFormat()

__all__ = ["ARROW", "ArrowFormat", "schema_differences"]
