"""Sample sources for ``stallfree shard``: ImageFolder trees, files grouped by basename, JSONL /
Parquet / Arrow tables, and existing tar shards.

Every source lists its items first, cheaply (paths and sizes, no contents), so the sharder can
plan shard boundaries deterministically before any byte is read; contents are read lazily, in
any process, through ``read_many`` (sources pickle as their paths and listing). Local paths only.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallfree.shards.errors import ShardError

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
TABLE_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
}
SOURCE_KINDS = ("imagefolder", "files", "jsonl", "parquet", "arrow", "tar")
KEY_COLUMNS = ("__key__", "key")
_SPACE = re.compile(r"\s")


class SourceError(ShardError):
    """The source cannot be used as given (unknown layout, no samples, conflicting fields)."""


class SourceReadError(SourceError):
    """A source file could not be read; ``path`` names it."""

    def __init__(self, message: str, *, path: str, key: str | None = None, offset: int | None = None) -> None:
        self.path = str(path)
        super().__init__(f"cannot read source file {path}: {message}", key=key, offset=offset)
        self.reason = message

    def __reduce__(self):
        return (_rebuild_read_error, (self.reason, self.path, self.key, self.offset))


def _rebuild_read_error(reason: str, path: str, key: str | None, offset: int | None) -> SourceReadError:
    return SourceReadError(reason, path=path, key=key, offset=offset)


@dataclass(frozen=True, slots=True)
class Item:
    """One future sample, as listed: a label for messages, field sizes for planning, and a
    source-specific reference used to read it. ``sizes`` are exact for files and tar members and
    an estimate (row-group or batch average) for table rows."""

    name: str
    sizes: tuple[int, ...]
    ref: Any

    @property
    def size(self) -> int:
        return sum(self.sizes)


def normalize_field(ext: str) -> str:
    """Field name from a file extension: lower case, no dot, ``jpeg`` -> ``jpg``."""
    ext = ext.lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


def split_key_field(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the base name."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return "", ""
    return (f"{head}/{stem}" if head else stem), ext


def _safe_key(stem: str) -> str:
    """Sample keys may hold no dot after the last '/' (WebDataset reads the first dot as the
    start of the field) and no whitespace; those characters become '_'."""
    head, _, base = stem.rpartition("/")
    if "." in base:
        base = base.replace(".", "_")
    out = f"{head}/{base}" if head else base
    return _SPACE.sub("_", out) if _SPACE.search(out) else out


def _read_file(path: str, key: str | None = None) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SourceReadError(f"{type(exc).__name__}: {exc.strerror or exc}", path=path, key=key) from exc


class Source:
    """Base: ``items()`` lists what will become samples; ``read_many`` yields, for each item in
    order, a sample dict or the ``SourceReadError`` that prevented reading it (so the caller
    applies its error policy). ``skipped`` lists files already found unreadable while listing."""

    kind = "source"

    def __init__(self) -> None:
        self.classes: list[str] | None = None
        self.skipped: list[dict[str, str]] = []
        self._items: list[Item] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_items"] = None  # workers get their items with each job; the listing may be huge
        return state

    def items(self) -> list[Item]:
        if self._items is None:
            self._items = self._list()
        return self._items

    def _list(self) -> list[Item]:
        raise NotImplementedError

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        for item in items:
            try:
                yield self.read(item)
            except SourceReadError as exc:
                yield exc

    def read(self, item: Item) -> dict[str, Any]:
        raise NotImplementedError

    def _skip_or_raise(self, on_error: str, path: str, exc: BaseException) -> None:
        err = exc if isinstance(exc, SourceReadError) else SourceReadError(str(exc), path=path)
        if on_error == "raise":
            raise err
        log.warning("skipping %s", err)
        self.skipped.append({"source": str(path), "error": err.reason})


def _walk_files(root: Path) -> Iterator[str]:
    """Regular-file paths under ``root`` (relative, '/'-separated), sorted, hidden entries skipped."""
    for dirpath, dirnames, filenames in os.walk(root, onerror=None, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if not name.startswith("."):
                yield name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"


def _stat_size(path: str, on_error: str, source: Source) -> int | None:
    try:
        st = os.stat(path)
    except OSError as exc:
        source._skip_or_raise(
            on_error, path, SourceReadError(f"{type(exc).__name__}: {exc.strerror}", path=path)
        )
        return None
    return st.st_size


class ImageFolderSource(Source):
    """``root/<class>/.../<image>``: one sample per image with fields ``<ext>`` and ``cls`` (the
    class's index in sorted class-name order, as torchvision's ImageFolder numbers them)."""

    kind = "imagefolder"

    def __init__(self, root: str | Path, *, on_error: str = "raise") -> None:
        super().__init__()
        self.root = Path(root)
        self.on_error = on_error
        self.classes = sorted(
            e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")
        )
        if not self.classes:
            raise SourceError(
                f"{self.root} has no class sub-folders (ImageFolder layout: root/<class>/<image>)"
            )

    def _list(self) -> list[Item]:
        items: list[Item] = []
        seen: dict[str, str] = {}
        for idx, cls in enumerate(self.classes):
            base = os.path.join(str(self.root), cls)
            field_for: dict[str, str] = {}
            for rel in _walk_files(Path(base)):
                stem, ext = os.path.splitext(rel)
                fieldname = field_for.get(ext)
                if fieldname is None:
                    if ext.lower() not in IMAGE_EXTENSIONS:
                        continue
                    fieldname = field_for[ext] = normalize_field(ext)
                path = f"{base}/{rel}"
                size = _stat_size(path, self.on_error, self)
                if size is None:
                    continue
                key = f"{cls}/{_safe_key(stem)}"
                if key in seen:
                    raise SourceError(f"{path} and {seen[key]} map to the same sample key {key!r}")
                seen[key] = path
                items.append(Item(path, (size, len(str(idx))), (key, fieldname, path, idx)))
        return items

    def read(self, item: Item) -> dict[str, Any]:
        key, fieldname, path, idx = item.ref
        return {"__key__": key, fieldname: _read_file(path, key), "cls": idx}


class GroupedFilesSource(Source):
    """A directory of files grouped by base name: ``a.jpg`` + ``a.json`` -> one sample ``a`` with
    fields ``jpg`` and ``json`` (WebDataset's key/field split; sub-folders become key prefixes)."""

    kind = "files"

    def __init__(self, root: str | Path, *, on_error: str = "raise") -> None:
        super().__init__()
        self.root = Path(root)
        self.on_error = on_error

    def _list(self) -> list[Item]:
        groups: dict[str, list[tuple[str, str]]] = {}
        for rel in _walk_files(self.root):
            key, ext = split_key_field(rel)
            key = _safe_key(key)
            if not key:
                log.debug("ignoring %s: no extension to name its field", rel)
                continue
            fields = groups.setdefault(key, [])
            fieldname = normalize_field(ext)
            if any(f == fieldname for f, _ in fields):
                raise SourceError(f"{self.root / rel}: sample {key!r} already has a field {fieldname!r}")
            fields.append((fieldname, str(self.root / rel)))
        items: list[Item] = []
        for key, fields in groups.items():
            sizes = [_stat_size(path, self.on_error, self) for _, path in fields]
            if any(s is None for s in sizes):
                continue
            items.append(Item(fields[0][1], tuple(sizes), (key, tuple(fields))))  # type: ignore[arg-type]
        return items

    def read(self, item: Item) -> dict[str, Any]:
        key, fields = item.ref
        sample: dict[str, Any] = {"__key__": key}
        for fieldname, path in fields:
            sample[fieldname] = _read_file(path, key)
        return sample


class TarSource(Source):
    """Existing tar shards (WebDataset layout), re-sharded with byte-identical fields: members are
    listed from the tar headers, and read by offset."""

    kind = "tar"

    def __init__(self, paths: Sequence[str | Path], *, on_error: str = "raise") -> None:
        super().__init__()
        self.paths = [str(p) for p in paths]
        self.on_error = on_error

    def _list(self) -> list[Item]:
        items: list[Item] = []
        for ti, path in enumerate(self.paths):
            try:
                items.extend(self._list_tar(ti, path))
            except (OSError, tarfile.TarError, SourceError) as exc:
                self._skip_or_raise(self.on_error, path, exc)
        return items

    def _list_tar(self, ti: int, path: str) -> list[Item]:
        groups: dict[str, list[tuple[str, int, int]]] = {}
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                key, ext = split_key_field(m.name)
                if not key:
                    log.debug("%s: ignoring member %s (no key.field name)", path, m.name)
                    continue
                fields = groups.setdefault(key, [])
                if any(f == ext for f, _, _ in fields):
                    raise SourceReadError(f"duplicate member {m.name}", path=path, key=key, offset=m.offset)
                fields.append((ext, m.offset_data, m.size))
        end = os.path.getsize(path)
        items = []
        for key, fields in groups.items():
            last = max(off + size for _, off, size in fields)
            if last > end:
                raise SourceReadError(
                    f"truncated: member data ends at {last}, file has {end} bytes", path=path, key=key
                )
            items.append(Item(f"{path}:{key}", tuple(s for _, _, s in fields), (ti, key, tuple(fields))))
        return items

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        handles: dict[int, Any] = {}
        try:
            for item in items:
                ti, key, fields = item.ref
                path = self.paths[ti]
                try:
                    f = handles.get(ti)
                    if f is None:
                        f = handles[ti] = open(path, "rb")
                    sample: dict[str, Any] = {"__key__": key}
                    for ext, off, size in fields:
                        f.seek(off)
                        data = f.read(size)
                        if len(data) != size:
                            raise SourceReadError(
                                f"short read of {size} bytes", path=path, key=key, offset=off
                            )
                        sample[ext] = data
                    yield sample
                except OSError as exc:
                    yield SourceReadError(f"{type(exc).__name__}: {exc}", path=path, key=key)
                except SourceReadError as exc:
                    yield exc
        finally:
            for f in handles.values():
                f.close()

    def read(self, item: Item) -> dict[str, Any]:
        result = next(self.read_many([item]))
        if isinstance(result, SourceReadError):
            raise result
        return result


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
        self._cache: tuple[tuple[int, int], list[dict[str, Any]]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cache"] = None
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
        items = []
        with _open_ipc(path) as reader:
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                n = batch.num_rows
                sizes = tuple(col.nbytes // max(n, 1) for col in batch.columns)
                start = base + len(items)
                items.extend(
                    Item(f"{path}:batch {b} row {r}", sizes, (fi, b, r, start + r)) for r in range(n)
                )
        return items

    # -- reading ---------------------------------------------------------------------------------
    def read(self, item: Item) -> dict[str, Any]:
        if self.kind == "jsonl":
            return self._read_jsonl(item)
        fi, chunk, row, row_number = item.ref
        rows = self._chunk_rows(fi, chunk)
        return self._sample(dict(rows[row]), row_number)

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
        for (fi, chunk), positions in wanted.items():
            try:
                table = self._load_chunk(fi, chunk)
                sub = table.take([items[pos].ref[2] for pos in positions])
            except SourceReadError as exc:
                for pos in positions:
                    where[pos] = exc
                continue
            for j, pos in enumerate(positions):
                where[pos] = (sub, j)
        for pos, it in enumerate(items):
            got = where.pop(pos)
            if isinstance(got, SourceReadError):
                yield got
                continue
            sub, j = got
            yield self._sample(sub.slice(j, 1).to_pylist()[0], it.ref[3])

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

    def _sample(self, row: dict[str, Any], row_number: int) -> dict[str, Any]:
        key = row.pop("__key__", None)
        if key is None:
            key = row.get("key")
        sample: dict[str, Any] = {"__key__": str(key) if key is not None else f"{row_number:09d}"}
        sample.update((k, v) for k, v in row.items() if v is not None)
        return sample

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
            row = json.loads(line)
        except OSError as exc:
            raise SourceReadError(f"{type(exc).__name__}: {exc}", path=path, offset=offset) from exc
        except ValueError as exc:
            raise SourceReadError(
                f"line {line_no} is not valid JSON: {exc}", path=path, offset=offset
            ) from exc
        if not isinstance(row, dict):
            raise SourceReadError(f"line {line_no} is not a JSON object", path=path, offset=offset)
        return self._sample(row, row_number)

    def _load_chunk(self, fi: int, chunk: int):
        """One Parquet row group or Arrow record batch, as Arrow data."""
        path = self.paths[fi]
        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                return pq.ParquetFile(path).read_row_group(chunk)
            with _open_ipc(path) as reader:
                return reader.get_batch(chunk)
        except (OSError, ValueError) as exc:
            raise SourceReadError(f"{type(exc).__name__}: {exc}", path=path) from exc

    def _chunk_rows(self, fi: int, chunk: int) -> list[dict[str, Any]]:
        if self._cache is not None and self._cache[0] == (fi, chunk):
            return self._cache[1]
        rows = self._load_chunk(fi, chunk).to_pylist()
        self._cache = ((fi, chunk), rows)
        return rows


class _open_ipc:
    """Arrow IPC file (or stream) reader over a memory map, as a context manager."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self):
        import pyarrow as pa

        self._mm = pa.memory_map(self.path, "r")
        try:
            return pa.ipc.open_file(self._mm)
        except pa.ArrowInvalid:
            self._mm.seek(0)
            table = pa.ipc.open_stream(self._mm).read_all()
            return _TableBatches(table)

    def __exit__(self, *exc: object) -> None:
        self._mm.close()


@dataclass
class _TableBatches:
    table: Any
    batches: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.batches = self.table.to_batches()
        self.schema = self.table.schema
        self.num_record_batches = len(self.batches)

    def get_batch(self, i: int):
        return self.batches[i]


def _expand(src: str) -> list[str]:
    if any(c in src for c in "*?["):
        paths = sorted(glob.glob(src))
        if not paths:
            raise SourceError(f"no files match {src}")
        return paths
    return [src]


def detect_kind(paths: Sequence[str]) -> str:
    """Guess the source kind from file suffixes or a directory's layout."""
    if len(paths) > 1 or Path(paths[0]).is_file():
        suffixes = {Path(p).suffix.lower() for p in paths}
        if suffixes == {".tar"}:
            return "tar"
        kinds = {TABLE_SUFFIXES.get(s) for s in suffixes}
        if len(kinds) == 1 and None not in kinds:
            return kinds.pop()  # type: ignore[return-value]
        raise SourceError(
            f"cannot tell the source kind of {paths[0]} (suffixes {sorted(suffixes)}); pass a kind"
        )
    root = Path(paths[0])
    if not root.is_dir():
        raise SourceError(f"source {root} does not exist")
    entries = [e for e in os.scandir(root) if not e.name.startswith(".")]
    files = [e for e in entries if e.is_file()]
    dirs = [e for e in entries if e.is_dir()]
    if files and not dirs:
        suffixes = {Path(e.name).suffix.lower() for e in files}
        if suffixes == {".tar"}:
            return "tar"
        kinds = {TABLE_SUFFIXES.get(s) for s in suffixes}
        if len(kinds) == 1 and None not in kinds:
            return kinds.pop()  # type: ignore[return-value]
    if dirs and not files:
        for d in dirs:
            if any(rel.lower().endswith(IMAGE_EXTENSIONS) for rel in _walk_files(Path(d.path))):
                return "imagefolder"
    return "files"


def open_source(
    src: str | Path | Sequence[str | Path], kind: str | None = None, *, on_error: str = "raise"
) -> Source:
    """A ``Source`` for a path (file, directory or glob) or list of paths; ``kind`` is one of
    ``SOURCE_KINDS`` or ``None`` to detect it."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if isinstance(src, (str, Path)):
        paths = _expand(str(src))
    else:
        paths = [p for s in src for p in _expand(str(s))]
    if not paths:
        raise SourceError("no source paths given")
    kind = kind or detect_kind(paths)
    if kind not in SOURCE_KINDS:
        raise SourceError(f"unknown source kind {kind!r}; choose one of {', '.join(SOURCE_KINDS)}")
    if kind in ("imagefolder", "files"):
        if len(paths) != 1 or not Path(paths[0]).is_dir():
            raise SourceError(f"a {kind} source is one directory, got {paths}")
        cls = ImageFolderSource if kind == "imagefolder" else GroupedFilesSource
        return cls(paths[0], on_error=on_error)
    if len(paths) == 1 and Path(paths[0]).is_dir():
        suffixes = (".tar",) if kind == "tar" else tuple(s for s, k in TABLE_SUFFIXES.items() if k == kind)
        paths = sorted(str(p) for p in Path(paths[0]).iterdir() if p.suffix.lower() in suffixes)
        if not paths:
            raise SourceError(f"no {kind} files in {src}")
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise SourceError(f"source file {missing[0]} does not exist")
    if kind == "tar":
        return TarSource(paths, on_error=on_error)
    return TableSource(paths, kind, on_error=on_error)
