"""Sample sources for ``stallfree shard``: ImageFolder trees, files grouped by basename, JSONL /
Parquet / Arrow tables, and existing tar shards. ``open_source`` picks one for a path (detecting
its kind); each kind lives in its own module, and every name is re-exported here:

- ``source_base``: the ``Source`` protocol, ``Item``, ``SourceError`` / ``SourceReadError``, helpers
- ``source_files``: ``ImageFolderSource``, ``GroupedFilesSource``
- ``source_tables``: ``TableSource`` (JSONL, Parquet, Arrow IPC)
- ``source_tar``: ``TarSource``

Every source lists its items first, cheaply (paths and sizes, no contents), so the sharder can
plan shard boundaries deterministically before any byte is read; contents are read lazily, in
any process, through ``read_many`` (sources pickle as their paths and listing). Local paths only.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

from stallfree.shards.source_base import (
    Item,
    Source,
    SourceError,
    SourceReadError,
    normalize_field,
    split_key_field,
    walk_files,
)
from stallfree.shards.source_files import IMAGE_EXTENSIONS, GroupedFilesSource, ImageFolderSource
from stallfree.shards.source_tables import KEY_COLUMNS, TABLE_SUFFIXES, TableSource
from stallfree.shards.source_tar import TarSource

SOURCE_KINDS = ("imagefolder", "files", "jsonl", "parquet", "arrow", "tar")


def _expand(src: str) -> list[str]:
    if any(c in src for c in "*?["):
        paths = sorted(glob.glob(src))
        if not paths:
            raise SourceError(f"no files match {src}")
        return paths
    return [src]


def _kind_of_suffixes(suffixes: set[str]) -> str | None:
    """``tar`` for all-tar files, a table kind when every suffix names the same one, else None."""
    if suffixes == {".tar"}:
        return "tar"
    kinds = {TABLE_SUFFIXES.get(s) for s in suffixes}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


def detect_kind(paths: Sequence[str]) -> str:
    """Guess the source kind from file suffixes or a directory's layout."""
    if len(paths) > 1 or Path(paths[0]).is_file():
        suffixes = {Path(p).suffix.lower() for p in paths}
        kind = _kind_of_suffixes(suffixes)
        if kind is not None:
            return kind
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
        kind = _kind_of_suffixes({Path(e.name).suffix.lower() for e in files})
        if kind is not None:
            return kind
    if dirs and not files:
        for d in dirs:
            if any(rel.lower().endswith(IMAGE_EXTENSIONS) for rel in walk_files(Path(d.path))):
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


__all__ = [
    "IMAGE_EXTENSIONS",
    "KEY_COLUMNS",
    "SOURCE_KINDS",
    "TABLE_SUFFIXES",
    "GroupedFilesSource",
    "ImageFolderSource",
    "Item",
    "Source",
    "SourceError",
    "SourceReadError",
    "TableSource",
    "TarSource",
    "detect_kind",
    "normalize_field",
    "open_source",
    "split_key_field",
]
