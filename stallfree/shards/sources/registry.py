"""Sample sources for ``stallfree shard``: ImageFolder trees, files grouped by basename, JSONL /
Parquet / Arrow tables, Hugging Face ``datasets`` data, MosaicML MDS and LitData datasets, and
existing tar shards. ``open_source`` picks one for a path (detecting its kind) or a ``datasets``
object; each kind lives in its own module, and every name is re-exported here:

- ``source_base``: the ``Source`` protocol, ``Item``, ``SourceError`` / ``SourceReadError``, helpers
- ``source_files``: ``ImageFolderSource``, ``GroupedFilesSource``
- ``source_tables``: ``TableSource`` (JSONL, Parquet, Arrow IPC)
- ``source_hf``: ``HFTableSource`` (``save_to_disk`` dirs, files with ``datasets`` features),
  ``HFDatasetSource`` (``datasets.Dataset`` objects), ``spool_iterable`` (``IterableDataset``)
- ``source_mds``: ``MDSSource``; ``source_litdata``: ``LitDataSource``
- ``source_tar``: ``TarSource``
- ``source_dataset``: ``DatasetSource``, a URL, or a stallfree dataset directory (a
  ``manifest.json``, or tars with ``.idx`` files), read as ``open_dataset`` reads it, sample by
  sample (imported lazily)

Every source lists its items first, cheaply (paths and sizes, no contents), so the sharder can
plan shard boundaries deterministically before any byte is read; contents are read lazily, in
any process, through ``read_many`` (sources pickle as their paths and listing).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stallfree.shards.arrow.hf import DATASET_DICT_FILE, is_save_to_disk_dir
from stallfree.shards.sources.base import (
    Item,
    Source,
    SourceError,
    SourceReadError,
    normalize_field,
    split_key_field,
    walk_files,
)
from stallfree.shards.sources.files import IMAGE_EXTENSIONS, GroupedFilesSource, ImageFolderSource
from stallfree.shards.sources.hf import (
    HFDatasetSource,
    HFTableSource,
    hf_table_source,
    is_hf_dataset,
    open_hf_dir,
    source_for_hf_object,
)
from stallfree.shards.sources.litdata import LitDataSource, is_litdata_index
from stallfree.shards.sources.mds import MDSSource, is_mds_index
from stallfree.shards.sources.tables import KEY_COLUMNS, TABLE_SUFFIXES, TableSource
from stallfree.shards.sources.tar import TarSource
from stallfree.storage.jsonfile import parse_json

SOURCE_KINDS = ("imagefolder", "files", "jsonl", "parquet", "arrow", "hf", "mds", "litdata", "tar")
# A stallfree dataset (read through open_dataset): detected, or asked for by this name from Python.
DATASET_KIND = "dataset"
MANIFEST_FILE = "manifest.json"  # (manifest.MANIFEST_NAME: not imported, sources stay light)
# A stallfree (or WebDataset) dataset without a manifest: its shards and their sidecars.
_DATASET_SUFFIXES = {".tar", ".idx", ".sums"}
# Kinds that are one directory with a layout of its own (not a set of files to list).
_DIRECTORY_KINDS = {"imagefolder": ImageFolderSource, "files": GroupedFilesSource, "mds": MDSSource,
                    "litdata": LitDataSource}  # fmt: skip
# Kinds read from a list of files: the suffixes that pick them out of a directory.
_FILE_SUFFIXES = {TarSource.kind: (".tar",)} | {
    kind: tuple(s for s, k in TABLE_SUFFIXES.items() if k == kind)
    for kind in dict.fromkeys(TABLE_SUFFIXES.values())
}


def _expand(src: str) -> list[str]:
    if any(c in src for c in "*?["):
        paths = sorted(glob.glob(src))
        if not paths:
            raise SourceError(f"no files match {src}")
        return paths
    return [src]


def _kind_of_suffixes(suffixes: set[str]) -> str | None:
    """``tar`` for all-tar files, a table kind when every suffix names the same one, else None."""
    if suffixes == set(_FILE_SUFFIXES[TarSource.kind]):
        return TarSource.kind
    kinds = {TABLE_SUFFIXES.get(s) for s in suffixes}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


def detect_kind(paths: Sequence[str]) -> str:
    """Guess the source kind from file suffixes or a directory's layout."""
    if len(paths) == 1 and Path(paths[0]).name == MANIFEST_FILE and Path(paths[0]).is_file():
        return DATASET_KIND
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
    kind = _layout_kind(root, {e.name for e in files})
    if kind is not None:
        return kind
    if files and not dirs:
        kind = _kind_of_suffixes({Path(e.name).suffix.lower() for e in files})
        if kind is not None:
            return kind
    if dirs and not files:
        for d in dirs:
            if any(rel.lower().endswith(IMAGE_EXTENSIONS) for rel in walk_files(Path(d.path))):
                return "imagefolder"
    return "files"


def _layout_kind(root: Path, names: set[str]) -> str | None:
    """The kind a directory's own files declare: a stallfree dataset (``dataset``: a
    ``manifest.json``, or tars with an ``.idx`` beside them, read sample by sample through
    ``open_dataset``: taken as a folder of files, its shards became five "samples", and
    ``--overwrite`` onto itself replaced it with those), a ``datasets`` ``save_to_disk``
    directory (``hf``; a DatasetDict is refused with its splits), or an ``index.json`` of MDS or
    LitData."""
    if MANIFEST_FILE in names or _is_indexed_tars(names):
        return DATASET_KIND
    if is_save_to_disk_dir(names) or DATASET_DICT_FILE in names:
        return "hf"
    if "index.json" in names:
        try:
            index = parse_json((root / "index.json").read_bytes(), str(root / "index.json"))
        except (OSError, ValueError):  # (parse_json's JSONFileError is a ValueError)
            return None  # not an MDS / LitData index: a file among others (--source mds says why)
        if is_mds_index(index):
            return "mds"
        if is_litdata_index(index):
            return "litdata"
    return None


def _is_indexed_tars(names: set[str]) -> bool:
    """Tar shards with their ``.idx`` (and maybe ``.sums``) beside them, and nothing else."""
    suffixes = {Path(n).suffix.lower() for n in names}
    if not names or not suffixes <= _DATASET_SUFFIXES or ".tar" not in suffixes:
        return False
    return any(Path(n).suffix.lower() == ".idx" and Path(n).stem + ".tar" in names for n in names)


def open_source(
    src: str | Path | Sequence[str | Path] | Any,
    kind: str | None = None,
    *,
    on_error: str = "raise",
    media_root: str | Path | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Source:
    """A ``Source`` for a path (file, directory or glob), a list of paths, a URL, or a
    ``datasets`` ``Dataset`` / ``IterableDataset``; ``kind`` is one of ``SOURCE_KINDS``,
    ``DATASET_KIND`` or ``None`` to detect it. A URL (``s3://...``) is read through
    ``open_dataset`` with ``storage_options`` (``source_dataset.DatasetSource``), and so is a
    stallfree dataset directory (``DATASET_KIND``), sample by sample. ``media_root``: for a ``datasets``
    object, the directory its path-only ``Image()`` / ``Audio()`` cells are relative to."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if isinstance(src, Source):
        return src
    if is_hf_dataset(src):
        return source_for_hf_object(src, media_root=media_root, on_error=on_error)
    if isinstance(src, str) and "://" in src and not src.startswith("file://"):
        if kind is not None:
            raise SourceError(
                f"{src}: a URL source is read as open_dataset reads it; the kind {kind!r} does not apply"
            )
        from stallfree.shards.sources.dataset import DatasetSource

        return DatasetSource(src, on_error=on_error, **(storage_options or {}))
    if isinstance(src, str) and src.startswith("file://"):
        src = src[len("file://") :]  # a local path: Path("file:///x") would be "file:/x", missing
    if isinstance(src, (str, Path)):
        paths = _expand(str(src))
    else:
        paths = [p for s in src for p in _expand(str(s))]
    if not paths:
        raise SourceError("no source paths given")
    kind = kind or detect_kind(paths)
    if kind == DATASET_KIND:
        if len(paths) != 1:
            raise SourceError(f"a dataset source is one directory or manifest.json, got {paths[:3]}")
        from stallfree.shards.sources.dataset import DatasetSource

        return DatasetSource(paths[0], on_error=on_error, **(storage_options or {}))
    if kind not in SOURCE_KINDS:
        raise SourceError(f"unknown source kind {kind!r}; choose one of {', '.join(SOURCE_KINDS)}")
    if kind in _DIRECTORY_KINDS:
        if len(paths) != 1 or not Path(paths[0]).is_dir():
            raise SourceError(f"a {kind} source is one directory, got {paths}")
        return _DIRECTORY_KINDS[kind](paths[0], on_error=on_error)
    if kind == "hf":
        if len(paths) == 1 and Path(paths[0]).is_dir():
            return _listed_from(open_hf_dir(paths[0], on_error=on_error), paths[0])
        kinds = {TABLE_SUFFIXES.get(Path(p).suffix.lower()) for p in paths}
        if len(kinds) != 1 or not kinds <= {"arrow", "parquet"}:
            raise SourceError(
                f"an hf source is a save_to_disk directory or .arrow / .parquet files, got {paths[:3]}"
            )
        return hf_table_source(paths, str(kinds.pop()), on_error=on_error, always=True)
    directory = None
    if len(paths) == 1 and Path(paths[0]).is_dir():
        directory = paths[0]
        paths = sorted(str(p) for p in Path(directory).iterdir() if p.suffix.lower() in _FILE_SUFFIXES[kind])
        if not paths:
            raise SourceError(f"no {kind} files in {src}")
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise SourceError(f"source file {missing[0]} does not exist")
    if kind == TarSource.kind:
        return _listed_from(TarSource(paths, on_error=on_error), directory)
    return _listed_from(hf_table_source(paths, kind, on_error=on_error), directory)


def _listed_from(source: Source, directory: str | None) -> Source:
    """``source`` with the directory its files were listed from as its ``root``: a destination
    inside it would be listed as source files by the next run (``parallel.check_destination``)."""
    if directory is not None:
        source.root = directory
    return source


__all__ = [
    "IMAGE_EXTENSIONS",
    "KEY_COLUMNS",
    "LitDataSource",
    "MDSSource",
    "SOURCE_KINDS",
    "TABLE_SUFFIXES",
    "GroupedFilesSource",
    "HFDatasetSource",
    "HFTableSource",
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
