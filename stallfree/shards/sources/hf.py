"""Hugging Face ``datasets`` data as a sharding source: a ``save_to_disk`` directory, ``.arrow`` /
``.parquet`` files that carry ``datasets`` features, and ``datasets.Dataset`` /
``IterableDataset`` objects handed to the Python API.

Rows keep their columns; ``Image()`` / ``Audio()`` cells become the encoded file's bytes (read from
the cell, or from a path inside the dataset: ``hf.py`` says why only inside) and ``ClassLabel``
names become the manifest's ``classes``. Without this, a ``save_to_disk`` directory sharded as
three file-samples (its .arrow and two JSON files) and image structs could not be written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from stallfree.shards.arrow.hf import (
    DATASET_DICT_FILE,
    HFColumns,
    binary_schema,
    class_sorted,
    columns_from_features,
    columns_of_schema,
    convert_row,
    read_local_media,
    read_saved_dataset,
    splits_of_dataset_dict,
)
from stallfree.shards.dataset_paths import OutsideDatasetError, refuse_link_out
from stallfree.shards.sources.base import Item, Source, SourceError, SourceReadError
from stallfree.shards.sources.tables import TableSource, _open_ipc, row_sample

_READ_CHUNK = 256  # rows of a datasets.Dataset taken per Arrow slice


class HFTableSource(TableSource):
    """``TableSource`` over Arrow (file or stream) / Parquet files written by ``datasets``: media
    structs become bytes, a path in one is read relative to the directory of its table file."""

    def __init__(
        self, paths: Sequence[str | Path], kind: str, columns: HFColumns, *, on_error: str = "raise"
    ) -> None:
        super().__init__(paths, kind, on_error=on_error)
        refuse_nested_media(columns, str(paths[0]) if paths else "source")
        self.columns = columns
        self.classes = columns.classes
        self.class_field = columns.class_field
        self._grouped: bool | None = None

    @property
    def grouped(self) -> bool:  # type: ignore[override]
        """Rows sorted by their ClassLabel (read once: that one column of every file)."""
        if self._grouped is None:
            self._grouped = self.class_field is not None and self._labels_sorted(self.class_field)
        return self._grouped

    def _labels_sorted(self, name: str) -> bool:
        import pyarrow as pa
        import pyarrow.parquet as pq

        chunks = []
        try:
            for path in self.paths:
                if self.kind == "parquet":
                    chunks.extend(pq.read_table(path, columns=[name]).column(name).chunks)
                else:
                    with _open_ipc(path) as reader:
                        for b in range(reader.num_record_batches):
                            chunks.append(reader.get_batch(b).column(name))
        except (OSError, ValueError, KeyError):
            return False  # listing reports an unreadable file with the on_error policy
        return class_sorted(pa.chunked_array(chunks) if chunks else [])

    def schema(self):
        schema = super().schema()
        return None if schema is None else binary_schema(schema, self.columns)

    def _sample(self, row: dict[str, Any], row_number: int, path: str) -> dict[str, Any]:
        sample = row_sample(row, row_number, path)
        base = os.path.dirname(path)
        where = f"{path} row {row_number}"
        try:
            return convert_row(sample, self.columns, where, lambda p: read_local_media(base, p, where))
        except ValueError as exc:
            raise SourceReadError(str(exc), path=path, key=sample["__key__"]) from None


def refuse_nested_media(columns: HFColumns, where: str) -> None:
    """A list (or struct) of ``Image()`` / ``Audio()`` cells has no sample field to go to: one
    field holds one encoded file, and a JSON list of structs cannot carry bytes. Refused up front
    rather than failing at the first row's write with a JSON error."""
    if columns.nested_media:
        raise SourceError(
            f"{where}: column(s) {', '.join(map(repr, columns.nested_media))} hold Image()/Audio() "
            "cells inside a list or struct; a sample field holds one encoded file. Flatten them "
            "into one column per image (datasets: Dataset.map) before sharding"
        )


def open_hf_dir(root: str | Path, *, on_error: str = "raise") -> HFTableSource:
    """The source for a ``Dataset.save_to_disk`` directory: its data files in ``state.json``'s
    order, its features from ``dataset_info.json`` (else the first file's schema)."""
    root = Path(root)
    if (root / DATASET_DICT_FILE).is_file():
        splits = splits_of_dataset_dict((root / DATASET_DICT_FILE).read_text())
        raise SourceError(
            f"{root} is a DatasetDict with splits {', '.join(splits) or '(none listed)'}: "
            f"shard one split directory, e.g. {root / (splits[0] if splits else 'train')}"
        )

    def read_text(name: str) -> str:
        refuse_link_out(str(root), str(root / name), f"{root} ({name})")
        return (root / name).read_text(encoding="utf-8", errors="surrogateescape")

    try:
        saved = read_saved_dataset(read_text, str(root))
    except OSError as exc:
        raise SourceReadError(f"{type(exc).__name__}: {exc.strerror or exc}", path=str(root)) from None
    except OutsideDatasetError:
        raise
    except ValueError as exc:
        raise SourceError(str(exc)) from None
    paths = [str(root / name) for name in saved.files]
    for path in paths:
        refuse_link_out(str(root), path, f"{root / 'state.json'}")
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise SourceError(f"{missing[0]} is listed in {root / 'state.json'} but does not exist")
    if not paths:
        raise SourceError(f"{root / 'state.json'} lists no data files")
    columns = saved.columns
    if not columns:
        columns = columns_of_schema(TableSource(paths[:1], "arrow").schema())
    return HFTableSource(paths, "arrow", columns, on_error=on_error)


def hf_table_source(
    paths: Sequence[str], kind: str, *, on_error: str = "raise", always: bool = False
) -> TableSource:
    """A plain ``TableSource``, or an ``HFTableSource`` when the first file's schema carries
    ``datasets`` features with media or class-label columns (or ``always``)."""
    plain = TableSource(paths, kind, on_error=on_error)
    if kind == "jsonl":
        return plain
    try:
        columns = columns_of_schema(plain.schema())
    except (OSError, ValueError):
        columns = HFColumns()  # listing reports the unreadable file with the on_error policy
    return HFTableSource(paths, kind, columns, on_error=on_error) if columns or always else plain


# -- datasets objects --------------------------------------------------------------------------
def is_hf_dataset(obj: Any) -> bool:
    """``obj`` is a ``datasets.Dataset`` or ``IterableDataset`` (checked without importing it)."""
    return type(obj).__module__.startswith("datasets.") and type(obj).__name__ in (
        "Dataset",
        "IterableDataset",
    )


class HFDatasetSource(Source):
    """A ``datasets.Dataset`` (map-style, any ``select`` / ``shuffle`` view of it) read as Arrow
    slices, decoding off: media cells stay encoded. A path-only media cell is read relative to
    ``media_root`` (default: the directory of the dataset's own cache files)."""

    kind = "hf"

    def __init__(
        self, dataset: Any, *, media_root: str | Path | None = None, on_error: str = "raise"
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.on_error = on_error
        self.columns = columns_from_features(dataset.features.to_dict())
        refuse_nested_media(self.columns, "the dataset")
        self.classes = self.columns.classes
        self.class_field = self.columns.class_field
        if media_root is None and dataset.cache_files:
            media_root = os.path.dirname(dataset.cache_files[0]["filename"])
        self.media_root = None if media_root is None else str(media_root)
        field = self.class_field
        self.grouped = field is not None and class_sorted(dataset.with_format("arrow")[field])

    def schema(self):
        return binary_schema(self.dataset.features.arrow_schema, self.columns)

    def _list(self) -> list[Item]:
        n = len(self.dataset)
        if n == 0:
            return []
        per_row = max(1, self.dataset.data.nbytes // max(len(self.dataset.data), 1))
        return [Item(f"row {i}", (per_row,), i) for i in range(n)]

    def read(self, item: Item) -> dict[str, Any]:
        got = next(iter(self.read_many([item])))
        if isinstance(got, SourceReadError):
            raise got
        return got

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        table_view = self.dataset.with_format("arrow")
        for start in range(0, len(items), _READ_CHUNK):
            chunk = items[start : start + _READ_CHUNK]
            rows = table_view[[it.ref for it in chunk]].to_pylist()
            for it, row in zip(chunk, rows, strict=True):
                try:
                    yield self._sample(row, it.ref)
                except SourceReadError as exc:
                    yield exc

    def _sample(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        where = f"dataset row {index}"
        return _media_to_bytes(row_sample(row, index, where), self.columns, where, where, self.media_root)


def spool_iterable(
    dataset: Any, *, media_root: str | Path | None = None, on_error: str = "raise", batch_rows: int = 256
) -> HFTableSource:
    """An ``IterableDataset`` has no length and may be a stream read once; the sharder plans from
    a listing. So the stream is written once, decoding off, to a temporary Arrow stream file
    (disk, not memory) that the returned source lists and reads like a ``save_to_disk`` file.
    Path-only media cells are read relative to ``media_root``. The file goes with the source."""
    import pyarrow as pa

    spool = tempfile.TemporaryDirectory(prefix="stallfree-hf-spool-")
    path = os.path.join(spool.name, "data-00000-of-00001.arrow")
    features = dataset.features
    schema = features.arrow_schema if features is not None else None
    columns = columns_from_features(features.to_dict() if features is not None else None)
    stream = dataset.decode(False) if hasattr(dataset, "decode") else dataset
    rows: list[dict[str, Any]] = []
    writer = None
    try:
        with open(path, "wb") as sink:
            for row in stream:
                rows.append(row)
                if len(rows) == batch_rows:
                    writer = _write_rows(sink, writer, rows, schema)
                    rows = []
            if rows or writer is None:
                writer = _write_rows(sink, writer, rows, schema)
            writer.close()
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        spool.cleanup()
        raise SourceError(f"cannot write the IterableDataset's rows as Arrow: {exc}") from None
    source = _SpooledSource([path], "arrow", columns, on_error=on_error)
    source.spool = spool
    source.media_root = None if media_root is None else str(media_root)
    return source


def _write_rows(sink: Any, writer: Any, rows: list[dict[str, Any]], schema: Any) -> Any:
    import pyarrow as pa

    batch = (
        pa.RecordBatch.from_pylist(rows, schema=schema)
        if schema is not None
        else pa.RecordBatch.from_pylist(rows)
    )
    if writer is None:
        writer = pa.ipc.new_stream(sink, batch.schema)
    if batch.num_rows:
        writer.write_batch(batch)
    return writer


class _SpooledSource(HFTableSource):
    """An ``HFTableSource`` over the spool file of an ``IterableDataset``; media paths resolve
    under ``media_root`` (the spool directory is ours, not the dataset's)."""

    spool: Any = None
    media_root: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["spool"] = None  # the parent owns (and removes) the file
        return state

    def _sample(self, row: dict[str, Any], row_number: int, path: str) -> dict[str, Any]:
        where = f"stream row {row_number}"
        return _media_to_bytes(row_sample(row, row_number, path), self.columns, where, where, self.media_root)


def _media_to_bytes(
    sample: dict[str, Any], columns: HFColumns, where: str, path: str, media_root: str | None
) -> dict[str, Any]:
    """``convert_row`` for a source whose path-only media cells resolve under ``media_root``
    (a ``datasets`` object has no table file of its own to resolve them against)."""

    def read_path(rel: str) -> bytes:
        if media_root is None:
            raise ValueError(
                f"{where}: media path {rel!r} and no media_root to resolve it under "
                "(pass media_root= the directory the paths are relative to)"
            )
        return read_local_media(media_root, rel, where)

    try:
        return convert_row(sample, columns, where, read_path)
    except ValueError as exc:
        raise SourceReadError(str(exc), path=path, key=sample["__key__"]) from None


def source_for_hf_object(
    obj: Any, *, media_root: str | Path | None = None, on_error: str = "raise"
) -> Source:
    """The source for a ``datasets.Dataset`` or ``IterableDataset``."""
    if type(obj).__name__ == "IterableDataset":
        return spool_iterable(obj, media_root=media_root, on_error=on_error)
    return HFDatasetSource(obj, media_root=media_root, on_error=on_error)


__all__ = [
    "HFDatasetSource",
    "HFTableSource",
    "hf_table_source",
    "is_hf_dataset",
    "open_hf_dir",
    "source_for_hf_object",
    "spool_iterable",
]
