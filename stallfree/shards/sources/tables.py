"""Table files as a source: rows of JSONL, Parquet or Arrow IPC files, one sample per row,
column types kept. Rows are listed per line / row group / record batch and read back in chunks."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from stallfree.errors import CorruptShardError, WriteError
from stallfree.shards.arrow.check import (
    BatchChecks,
    DamagedArrowError,
    check_schema_names,
)
from stallfree.shards.arrow.reader import open_batches
from stallfree.shards.naming import check_key
from stallfree.shards.sources.base import Item, Source, SourceError, SourceReadError
from stallfree.storage.jsonfile import parse_json

TABLE_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
}
KEY_COLUMNS = ("__key__", "key")
_BLOCK = 64  # rows of a shuffled shard converted to Python at a time, per source chunk


class TableSource(Source):
    """Rows of JSONL / Parquet / Arrow IPC files, one sample per row, column types kept. The key
    comes from a ``__key__`` (dropped from the fields) or ``key`` column, else the global row
    number (zero-padded). Null values are left out of the sample."""

    def __init__(self, paths: Sequence[str | Path], kind: str, *, on_error: str = "raise") -> None:
        super().__init__()
        if kind not in ("jsonl", "parquet", "arrow"):
            raise SourceError(f"unknown table kind {kind!r}")
        self.kind = kind
        self.paths = [str(p) for p in paths]
        self.on_error = on_error
        self.root: str | None = None  # the directory they were listed from, if one was given
        self._cache: tuple[tuple[int, int], list[dict[str, Any]]] | None = None
        self._open: tuple[int, int, Any, Any] | None = None  # (pid, file, context, reader)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cache"] = None
        state["_open"] = None
        return state

    def schema(self):
        """The Arrow schema of the table files (``None`` for JSONL: types come from the values)."""
        if self.kind == "jsonl":
            return None
        path = self.paths[0]
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return pq.read_schema(path)
        with _open_ipc(path) as reader:
            return reader.schema

    # -- listing ---------------------------------------------------------------------------------
    def _list(self) -> list[Item]:
        items: list[Item] = []
        lister = {"jsonl": self._list_jsonl, "parquet": self._list_parquet, "arrow": self._list_arrow}[
            self.kind
        ]
        for fi, path in enumerate(self.paths):
            try:
                rows = lister(fi, path, len(items))
            except CorruptShardError as exc:  # a damaged table file (arrow_check)
                self._skip_or_raise(self.on_error, path, _read_error(exc, path))
                continue
            except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
                self._skip_or_raise(
                    self.on_error, path, SourceReadError(f"{type(exc).__name__}: {exc}", path=path)
                )
                continue
            items.extend(rows)
        return items

    def _list_jsonl(self, fi: int, path: str, base: int) -> list[Item]:
        items = []
        offset = 0
        line_no = 0
        with open(path, "rb") as f:
            for line in f:
                line_no += 1
                if line.strip():
                    ref = (fi, offset, len(line), line_no, base + len(items))
                    items.append(Item(f"{path}:{line_no}", (len(line),), ref))
                offset += len(line)
        return items

    def _list_parquet(self, fi: int, path: str, base: int) -> list[Item]:
        import pyarrow.parquet as pq

        md = pq.ParquetFile(path).metadata
        items = []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            n = rg.num_rows
            sizes = tuple(rg.column(c).total_uncompressed_size // max(n, 1) for c in range(rg.num_columns))
            start = base + len(items)
            items.extend(Item(f"{path}:group {g} row {r}", sizes, (fi, g, r, start + r)) for r in range(n))
        return items

    def _list_arrow(self, fi: int, path: str, base: int) -> list[Item]:
        """Every row of every sound record batch. A damaged batch is the error policy's (skip
        loses that batch, not the file); so is a damaged stream message, after which the rest
        of a stream cannot be found. Row numbers (keys of rows without one) count a skipped
        batch's rows as it declares them, so other rows keep their keys."""
        items: list[Item] = []
        rows = 0
        with _open_ipc(path) as reader:
            for b in range(reader.num_record_batches):
                try:
                    batch = reader.get_batch(b)
                except CorruptShardError as exc:
                    rows += reader.declared_rows(b)
                    self._skip_or_raise(self.on_error, path, _read_error(exc, path))
                    continue
                n = batch.num_rows
                sizes = tuple(col.nbytes // max(n, 1) for col in batch.columns)
                start = base + rows
                items.extend(
                    Item(f"{path}:batch {b} row {r}", sizes, (fi, b, r, start + r)) for r in range(n)
                )
                rows += n
            if reader.damage is not None:
                self._skip_or_raise(self.on_error, path, _read_error(reader.damage, path))
        return items

    # -- reading ---------------------------------------------------------------------------------
    def read(self, item: Item) -> dict[str, Any]:
        if self.kind == "jsonl":
            return self._read_jsonl(item)
        fi, chunk, row, row_number = item.ref
        rows = self._chunk_rows(fi, chunk)
        return self._sample(dict(rows[row]), row_number, self.paths[fi])

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        if self.kind == "jsonl":
            yield from self._read_jsonl_many(items)
            return
        chunks = [it.ref[:2] for it in items]
        if all(a <= b for a, b in zip(chunks, chunks[1:], strict=False)):  # file order: stream by chunk
            yield from super().read_many(items)
            return
        yield from self._read_shuffled(items)

    def _read_shuffled(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        """Rows in any order: load each needed chunk once, keep only this shard's rows (as Arrow,
        compact), then yield in the asked order. Shuffled input would otherwise re-read a whole
        row group per row."""
        wanted: dict[tuple[int, int], list[int]] = {}
        for pos, it in enumerate(items):
            wanted.setdefault(it.ref[:2], []).append(pos)
        where: dict[int, Any] = {}
        for (fi, chunk), positions in sorted(wanted.items()):  # file by file: each opened once
            try:
                table = self._load_chunk(fi, chunk)
                sub = table.take([items[pos].ref[2] for pos in positions])
            except SourceReadError as exc:
                for pos in positions:
                    where[pos] = exc
                continue
            for j, pos in enumerate(positions):
                where[pos] = ((fi, chunk), sub, j)
        # Each chunk's rows are asked for in the order of its ``sub`` (positions were appended in
        # order), so each is converted a block at a time as the walk reaches it: a Python object
        # per row (to_pylist of a 1-row slice) cost ~100 us a row; converting whole ``sub``s at
        # once would hold the shard's rows as Python bytes all together.
        blocks: dict[tuple[int, int], tuple[int, list[dict[str, Any]]]] = {}
        for pos, it in enumerate(items):
            got = where.pop(pos)
            if isinstance(got, SourceReadError):
                yield got
                continue
            chunk_key, sub, j = got
            start = j - j % _BLOCK
            block = blocks.get(chunk_key)
            if block is None or block[0] != start:
                block = blocks[chunk_key] = (start, sub.slice(start, _BLOCK).to_pylist())
            try:
                yield self._sample(block[1][j - start], it.ref[3], self.paths[it.ref[0]])
            except SourceReadError as exc:
                yield exc

    def _read_jsonl_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        handles: dict[int, Any] = {}
        try:
            for item in items:
                try:
                    yield self._read_jsonl(item, handles)
                except SourceReadError as exc:
                    yield exc
        finally:
            for f in handles.values():
                f.close()

    def _sample(self, row: dict[str, Any], row_number: int, path: str) -> dict[str, Any]:
        return row_sample(row, row_number, path)

    def _read_jsonl(self, item: Item, handles: dict[int, Any] | None = None) -> dict[str, Any]:
        fi, offset, length, line_no, row_number = item.ref
        path = self.paths[fi]
        try:
            if handles is None:
                with open(path, "rb") as f:
                    f.seek(offset)
                    line = f.read(length)
            else:
                f = handles.get(fi)
                if f is None:
                    f = handles[fi] = open(path, "rb")  # noqa: SIM115 - closed by _read_jsonl_many
                f.seek(offset)
                line = f.read(length)
            row = parse_json(line, path)  # (a JSONFileError, a ValueError, for any bad line)
        except OSError as exc:
            raise SourceReadError(f"{type(exc).__name__}: {exc}", path=path, offset=offset) from exc
        except ValueError as exc:
            raise SourceReadError(
                f"line {line_no} is not valid JSON: {exc}", path=path, offset=offset
            ) from exc
        if not isinstance(row, dict):
            raise SourceReadError(f"line {line_no} is not a JSON object", path=path, offset=offset)
        return self._sample(row, row_number, path)

    def _load_chunk(self, fi: int, chunk: int):
        """One Parquet row group or Arrow record batch, as Arrow data."""
        path = self.paths[fi]
        try:
            reader = self._reader_of(fi)
            if self.kind == "parquet":
                return validated_table(reader.read_row_group(chunk), path, chunk)
            return reader.get_batch(chunk)  # validated (once per open)
        except CorruptShardError as exc:
            raise _read_error(exc, path) from None
        except (OSError, ValueError) as exc:
            raise SourceReadError(f"{type(exc).__name__}: {exc}", path=path) from exc

    def _reader_of(self, fi: int):
        """File ``fi`` opened, the last one kept (per process): opening an Arrow stream parses it
        whole (after a failed try as an IPC file), which per record batch cost more than the
        batch itself when a shard's rows span many small batches (a shuffled shard does)."""
        held = self._open
        if held is not None and held[:2] == (os.getpid(), fi):
            return held[3]
        self._close_open()
        path = self.paths[fi]
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            self._open = (os.getpid(), fi, None, pq.ParquetFile(path))
        else:
            ctx = _open_ipc(path)
            self._open = (os.getpid(), fi, ctx, ctx.__enter__())
        return self._open[3]

    def _close_open(self) -> None:
        held, self._open = self._open, None
        if held is not None and held[2] is not None and held[0] == os.getpid():
            held[2].__exit__(None, None, None)

    def _chunk_rows(self, fi: int, chunk: int) -> list[dict[str, Any]]:
        if self._cache is not None and self._cache[0] == (fi, chunk):
            return self._cache[1]
        rows = self._load_chunk(fi, chunk).to_pylist()
        self._cache = ((fi, chunk), rows)
        return rows


def row_sample(row: dict[str, Any], row_number: int, path: str) -> dict[str, Any]:
    """A table row as a sample. A key column value no shard may hold (``../x``, ``/abs``, a dot
    in its last part, whitespace) is a SourceReadError here, so ``on_error`` applies to it
    (skip drops the row and lists it) instead of the writer's WriteError ending the run."""
    key = row.pop("__key__", None)
    if key is None:
        key = row.get("key")
    key = str(key) if key is not None else f"{row_number:09d}"
    try:
        check_key(key)
    except WriteError as exc:
        raise SourceReadError(f"row {row_number}: {exc.reason}", path=path, key=key) from None
    sample: dict[str, Any] = {"__key__": key}
    sample.update((k, v) for k, v in row.items() if v is not None)
    return sample


def _read_error(exc: CorruptShardError, path: str) -> SourceReadError:
    """A damaged table file's error as the sources' error policy takes it (naming the file)."""
    return SourceReadError(exc.reason, path=path, key=exc.key, offset=exc.offset)


def validated_table(table: Any, path: str, group: int) -> Any:
    """A Parquet row group as decoded, checked like an Arrow batch before rows are converted."""
    import pyarrow as pa

    try:
        table.validate(full=True)
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise DamagedArrowError(f"row group {group} is damaged: {exc}", shard=path) from None
    return table


class _open_ipc:
    """The record batches of an Arrow IPC file (or stream) over a memory map, as a context
    manager, opened by the shards' one opener (``arrow.reader.open_batches``: the footer checked
    before pyarrow trusts it, a stream walked message by message so damage is named by batch and
    byte offset, ``damage`` where the walk stopped); ``get_batch(b)`` is validated
    (``arrow.check``) before anything converts its rows."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> _IpcBatches:
        import pyarrow as pa

        self._mm = pa.memory_map(self.path, "r")
        try:
            return _IpcBatches(self._mm, self.path)
        except BaseException:  # __exit__ does not run when __enter__ raises
            self._mm.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self._mm.close()


class _IpcBatches:
    """An Arrow IPC file's or stream's batches, validated on the way out."""

    def __init__(self, mm: Any, path: str) -> None:
        self.path = path
        # the shards' one table opener; a stream message that does not parse ends the walk
        # (``damage``) and the batches before it stay readable
        try:
            self._tables = open_batches(mm, path, path, True, None, partial=True)
        except DamagedArrowError:
            raise
        except CorruptShardError as exc:  # in no table layout: a ValueError too, as pyarrow's was
            raise DamagedArrowError(exc.reason, shard=exc.shard, offset=exc.offset) from None
        self.damage: CorruptShardError | None = getattr(self._tables, "damage", None)
        self.schema = self._tables.schema
        self.num_record_batches = self._tables.num_record_batches
        self._offsets = [self._tables.offset_of(b) for b in range(self.num_record_batches)]
        check_schema_names(self.schema, path)  # validate() does not look at names
        self._checks = BatchChecks(self.num_record_batches)

    def _raw(self, b: int) -> Any:
        import pyarrow as pa

        try:
            return self._tables.get_batch(b)
        except (pa.ArrowException, OSError) as exc:
            raise DamagedArrowError(
                f"cannot read record batch {b}: {exc}", shard=self.path, offset=self._offsets[b]
            ) from None

    def get_batch(self, b: int) -> Any:
        return self._checks.check(self._raw(b), b, shard=self.path, offset=self._offsets[b])

    def declared_rows(self, b: int) -> int:
        """What batch ``b`` says it holds (0 where even that cannot be read)."""
        try:
            return max(0, self._raw(b).num_rows)
        except CorruptShardError:
            return 0
