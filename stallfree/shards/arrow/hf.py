"""Hugging Face ``datasets`` conventions, read without the library: the feature types a table
carries (the ``huggingface`` entry of an Arrow/Parquet schema's metadata, or a ``save_to_disk``
directory's ``dataset_info.json``), and what the sharder and ``open_dataset`` do with them.

Two kinds of feature change what a row holds. ``Image()`` and ``Audio()`` columns (and
``Video()``, ``Pdf()``, ``Nifti()``: the same storage) are structs ``{"bytes": ..., "path":
...}``: the encoded file is ``bytes``, or, when that is null, the file at ``path``. A sample gets
the encoded bytes (what ``ImageDecode`` and WebDataset's readers expect), so a path is read
here, and only *inside* the dataset: relative, no ``..``, resolved against the directory holding
the table file. A dataset is data from elsewhere; a path such as ``/etc/passwd`` or
``../../secrets`` in it must not pull a file of this machine into the shards. ``ClassLabel``
columns hold class indices; their names become the manifest's ``classes`` (as for ImageFolder).

All of this is JSON: nothing here unpickles.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stallfree.storage.jsonfile import parse_json

log = logging.getLogger(__name__)

# Feature types stored as a {"bytes", "path"} struct holding one encoded file.
MEDIA_TYPES = ("Image", "Audio", "Video", "Pdf", "Nifti")
SAVE_TO_DISK_FILES = ("dataset_info.json", "state.json")
DATASET_DICT_FILE = "dataset_dict.json"


@dataclass(frozen=True)
class HFColumns:
    """The top-level columns whose Hugging Face feature type matters to us: media columns
    (name -> ``Image`` / ``Audio``) and class-label columns (name -> class names)."""

    media: Mapping[str, str] = field(default_factory=dict)
    class_labels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    nested_media: tuple[str, ...] = ()  # media inside a list or struct column: no field can hold it

    def __bool__(self) -> bool:
        return bool(self.media or self.class_labels or self.nested_media)

    @property
    def class_field(self) -> str | None:
        """The column whose names become the manifest's ``classes``: ``label`` if it is a
        ClassLabel, else the first ClassLabel column (the manifest holds one class list)."""
        if not self.class_labels:
            return None
        return "label" if "label" in self.class_labels else next(iter(self.class_labels))

    @property
    def classes(self) -> list[str] | None:
        name = self.class_field
        return list(self.class_labels[name]) if name is not None else None


def columns_from_features(features: Mapping[str, Any] | None) -> HFColumns:
    """``HFColumns`` from a features dict as ``datasets`` serialises it (``{"image": {"_type":
    "Image"}, "label": {"_type": "ClassLabel", "names": [...]}, ...}``)."""
    media: dict[str, str] = {}
    labels: dict[str, tuple[str, ...]] = {}
    nested: list[str] = []
    for name, spec in (features or {}).items():
        kind = spec.get("_type") if isinstance(spec, dict) else None
        if kind in MEDIA_TYPES:
            media[name] = kind
        elif kind == "ClassLabel" and isinstance(spec.get("names"), list):
            labels[name] = tuple(str(n) for n in spec["names"])
        elif _holds_media(spec):
            nested.append(name)
    return HFColumns(media, labels, tuple(nested))


def _holds_media(spec: Any) -> bool:
    """A feature spec with an ``Image()`` / ``Audio()`` somewhere inside (a list of images, a
    struct with an image member)."""
    if isinstance(spec, dict):
        return spec.get("_type") in MEDIA_TYPES or any(_holds_media(v) for v in spec.values())
    if isinstance(spec, list):
        return any(_holds_media(v) for v in spec)
    return False


def features_of_schema(schema: Any) -> dict[str, Any] | None:
    """The features dict ``datasets`` stores in an Arrow or Parquet schema's metadata, or None."""
    meta = getattr(schema, "metadata", None) or {}
    raw = meta.get(b"huggingface")
    if raw is None:
        return None
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        log.warning("ignoring unreadable 'huggingface' schema metadata")
        return None
    features = (info.get("info") or {}).get("features") if isinstance(info, dict) else None
    return features if isinstance(features, dict) else None


def columns_of_schema(schema: Any) -> HFColumns:
    return columns_from_features(features_of_schema(schema))


def is_save_to_disk_dir(entries: set[str]) -> bool:
    """A directory listing (file names) is a ``Dataset.save_to_disk`` directory."""
    return all(name in entries for name in SAVE_TO_DISK_FILES)


@dataclass(frozen=True)
class SavedDataset:
    """What a ``save_to_disk`` directory's JSON files say: its table files in order (relative
    names) and its columns of interest."""

    files: list[str]
    columns: HFColumns


def read_saved_dataset(read_text: Callable[[str], str], where: str) -> SavedDataset:
    """Parse ``state.json`` (the data files, in row order) and ``dataset_info.json`` (features)
    through ``read_text(name)``; ValueError naming ``where`` and the file for a bad one."""
    try:
        state = parse_json(read_text("state.json"), f"{where}/state.json")
        files = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}/state.json is not a datasets save_to_disk state: {exc!r}") from None
    for name in files:
        safe_relative(name, f"{where}/state.json")
    try:
        info = parse_json(read_text("dataset_info.json"), f"{where}/dataset_info.json")
    except ValueError as exc:
        raise ValueError(f"{where}/dataset_info.json is not valid JSON: {exc}") from None
    features = info.get("features") if isinstance(info, dict) else None
    return SavedDataset(files, columns_from_features(features if isinstance(features, dict) else None))


def splits_of_dataset_dict(text: str) -> list[str]:
    """The split names of a ``DatasetDict.save_to_disk`` directory's ``dataset_dict.json``."""
    try:
        splits = parse_json(text, DATASET_DICT_FILE).get("splits")
    except (ValueError, AttributeError):  # (parse_json's JSONFileError is a ValueError)
        splits = None
    return [str(s) for s in splits] if isinstance(splits, list) else []


def safe_relative(path: str, where: str) -> str:
    """``path`` as a normalised relative POSIX path inside its dataset; ValueError for an absolute
    path, a ``..`` that leaves the dataset, or an empty one."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: empty media path")
    text = path.replace("\\", "/")
    if text.startswith("/") or posixpath.isabs(text) or (len(text) > 1 and text[1] == ":"):
        raise ValueError(f"{where}: absolute media path {path!r}; paths must be relative to the dataset")
    if "://" in text:
        raise ValueError(f"{where}: media path {path!r} is a URL; paths must be relative to the dataset")
    norm = posixpath.normpath(text)
    if norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"{where}: media path {path!r} points outside the dataset")
    return norm


def read_local_media(base: str, path: str, where: str) -> bytes:
    """The file at relative ``path`` under local directory ``base``. Symbolic links are followed
    only while the target stays inside ``base`` (a link out of the dataset is refused too)."""
    rel = safe_relative(path, where)
    root = os.path.realpath(base)
    full = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([root, full]) != root:
        raise ValueError(f"{where}: media path {path!r} resolves outside the dataset ({base})")
    try:
        with open(full, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(
            f"{where}: cannot read media file {path!r} under {base}: {exc.strerror or exc}"
        ) from None


def media_bytes(value: Any, column: str, where: str, read_path: Callable[[str], bytes]) -> bytes | None:
    """The encoded file an ``Image()`` / ``Audio()`` cell holds: its ``bytes``, else the file at
    its ``path`` through ``read_path`` (which must enforce ``safe_relative``); None for a null cell."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: column {column!r} holds {type(value).__name__}, not a media struct")
    data = value.get("bytes")
    if data is not None:
        return bytes(data)
    path = value.get("path")
    if not path:
        raise ValueError(f"{where}: column {column!r} has neither bytes nor a path")
    return read_path(path)


def convert_row(
    row: dict[str, Any], columns: HFColumns, where: str, read_path: Callable[[str], bytes]
) -> dict[str, Any]:
    """``row`` with each media struct replaced by its encoded bytes (null cells dropped)."""
    for name in columns.media:
        if name in row:
            data = media_bytes(row[name], name, where, read_path)
            if data is None:
                del row[name]
            else:
                row[name] = data
    return row


def row_media_converter(
    convert: Callable[..., dict[str, Any]], schema: Any, fs: Any, path: str, shard: str, local: bool
):
    """Wrap a shard reader's row converter (``arrow.row_converter``) so that rows of a table with
    ``datasets`` media columns come out with the encoded bytes (what ``ImageDecode`` reads); a
    path-only cell is read relative to the table file's directory, inside the dataset only.
    Returns ``convert`` itself for any other table."""
    columns = columns_of_schema(schema)
    if not columns.media:
        return convert
    from stallfree.errors import CorruptShardError, ShardError
    from stallfree.storage import remote

    base = posixpath.dirname(path)

    def read_path(rel: str, where: str) -> bytes:
        if local:
            return read_local_media(base, rel, where)
        full = posixpath.join(base, safe_relative(rel, where))
        try:  # checked and retried like every remote read (storage/remote.py)
            return remote.read_file(fs, full, shard=shard)
        except (OSError, ShardError) as exc:
            raise ValueError(f"{where}: cannot read media file {rel!r} at {full}: {exc}") from None

    def converted(batch: Any, row: int, shard_row: int | None = None) -> dict[str, Any]:
        out = convert(batch, row, shard_row)
        where = f"row {row if shard_row is None else shard_row}"
        try:
            return convert_row(out, columns, where, lambda rel: read_path(rel, where))
        except ValueError as exc:
            raise CorruptShardError(str(exc), shard=shard, key=out.get("__key__")) from None

    return converted


def class_sorted(labels: Any) -> bool:
    """Labels (an Arrow array or chunked array, or a sequence) in non-decreasing order with more
    than one class: rows grouped by class, as ``datasets``' imagefolder loader writes them (one
    class after another). Such a source is sharded shuffled by default, as an ImageFolder is."""
    import numpy as np

    if hasattr(labels, "to_numpy"):
        values = np.asarray(labels.fill_null(-1).to_numpy(zero_copy_only=False))
    else:
        values = np.asarray([-1 if v is None else v for v in labels])
    if values.size < 2:
        return False
    return bool(np.all(values[1:] >= values[:-1]) and values[0] != values[-1])


def binary_schema(schema: Any, columns: HFColumns) -> Any:
    """``schema`` with each media column as ``binary`` (what ``convert_row`` makes of it)."""
    import pyarrow as pa

    for name in columns.media:
        i = schema.get_field_index(name)
        if i >= 0:
            schema = schema.set(i, pa.field(name, pa.binary()))
    return schema


__all__ = [
    "DATASET_DICT_FILE",
    "MEDIA_TYPES",
    "SAVE_TO_DISK_FILES",
    "HFColumns",
    "SavedDataset",
    "binary_schema",
    "class_sorted",
    "columns_from_features",
    "columns_of_schema",
    "convert_row",
    "features_of_schema",
    "is_save_to_disk_dir",
    "media_bytes",
    "read_local_media",
    "read_saved_dataset",
    "row_media_converter",
    "safe_relative",
    "splits_of_dataset_dict",
]
