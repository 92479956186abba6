"""MosaicML Streaming (MDS) datasets as a sharding source, read from the published layout with no
dependency on ``mosaicml-streaming``.

``index.json``: ``{"version": 2, "shards": [...]}``; each shard entry names its file
(``raw_data.basename``, or ``zip_data.basename`` when compressed), its sample count, and the
columns: ``column_names`` (sorted), ``column_encodings``, ``column_sizes`` (bytes for a fixed-size
encoding, null for a variable one). A shard file is an offset table (``source_offsets``) with the
shard's JSON config between the table and the data; a sample is one ``uint32`` size per
variable-size column, then each column's bytes in column order.

Cells keep their bytes where the encoding is a byte format (``bytes``, ``jpeg``, ``png``, ``json``
as its text, ``str``), so shards hold exactly what the MDS dataset held; numbers and arrays are
decoded to values. ``pkl`` columns are refused: we never unpickle data read from a dataset.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stallfree.shards.sources.base import SourceError
from stallfree.shards.sources.offsets import (
    OffsetTableSource,
    ShardFile,
    decompressor,
    image_array,
    shard_path,
)

INDEX_NAME = "index.json"
_SCALARS = {
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "float16": np.float16, "float32": np.float32, "float64": np.float64,
}  # fmt: skip
# ndarray encoding: dtype codes in its header (value dtype; shape dtype in the low 2 bits).
_ND_VALUE = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
             34: "float32", 64: "uint64", 65: "int64", 66: "float64"}  # fmt: skip
_ND_SHAPE = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}
_BYTE_ENCODINGS = ("bytes", "jpeg", "png")
_REFUSED = {
    "pkl": "pickled values (stallfree never unpickles data read from a dataset)",
    "list[pil]": "lists of images",
    "list[jpeg]": "lists of images",
    "list[png]": "lists of images",
    "jpeg_array": "lists of images",
    "jpegarray": "lists of images",
}


Column = tuple[str, str, "int | None"]  # (name, encoding, fixed size or None: variable)


@dataclass(frozen=True)
class MDSShard:
    """One shard of an MDS index: its file and its columns, in the order a sample stores them;
    ``other``: the shard's other file where the index names two (raw and compressed), the one
    not chosen (a staged copy of a dataset read in place is whichever was chosen there)."""

    file: ShardFile
    columns: tuple[Column, ...]
    other: ShardFile | None = None


def is_mds_index(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("shards"), list)


def mds_shards(
    index: Any,
    root: str,
    index_path: str,
    *,
    exists: Callable[[str], bool] = os.path.exists,
    local: bool = True,
) -> list[MDSShard]:
    """The shards an MDS ``index.json`` (parsed: ``index``) lists, checked: each file inside
    ``root`` (``local``: no link out of it either), a sample count, known column encodings (a
    ``pkl`` column is refused: we never unpickle), a codec we can undo. ``exists`` tells whether
    the raw file of a compressed shard is there (it is read rather than the compressed one).
    SourceError naming ``index_path`` and the shard's number for anything else."""
    if not is_mds_index(index):
        raise SourceError(f"{index_path} is not an MDS index (no 'shards' list)")
    shards = []
    for i, shard in enumerate(index["shards"]):
        where = f"{index_path} shard {i}"
        if not isinstance(shard, dict):
            raise SourceError(f"{where}: not an object")
        if shard.get("format") != "mds":
            raise SourceError(
                f"{where}: format {shard.get('format')!r}; only 'mds' shards are read (not xsv/json)"
            )
        raw, zipped = _files_of(shard, root, where, local)
        if raw is not None and (zipped is None or exists(raw.path)):
            file, other = raw, zipped  # the raw file when present (a cache may hold it decompressed)
        elif zipped is not None:
            file, other = zipped, raw
        else:
            raise SourceError(f"{where}: names no shard file (raw_data / zip_data)")
        shards.append(MDSShard(file, _columns_of(shard, where), other))
    return shards


def _files_of(
    shard: dict[str, Any], root: str, where: str, local: bool
) -> tuple[ShardFile | None, ShardFile | None]:
    """The shard's raw file and compressed file, each None where the index names none."""
    raw = shard.get("raw_data") or {}
    zipped = shard.get("zip_data") or {}
    if not isinstance(raw, dict) or not isinstance(zipped, dict):
        raise SourceError(f"{where}: raw_data / zip_data must be objects")
    samples = shard.get("samples")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        raise SourceError(f"{where}: 'samples' must be a count, got {samples!r}")
    raw_file = zip_file = None
    if raw.get("basename"):
        raw_file = ShardFile(shard_path(root, raw["basename"], where, local=local), samples)
    if zipped.get("basename"):
        compression = shard.get("compression")
        decompressor(compression, where)  # an unsupported codec fails here, before any work
        raw_bytes = raw.get("bytes")
        if not isinstance(raw_bytes, int) or isinstance(raw_bytes, bool) or raw_bytes < 0:
            raw_bytes = None
        path = shard_path(root, zipped["basename"], where, local=local)
        zip_file = ShardFile(path, samples, str(compression), raw_bytes)
    return raw_file, zip_file


def _columns_of(shard: dict[str, Any], where: str) -> tuple[Column, ...]:
    names, encodings, sizes = (shard.get(k) for k in ("column_names", "column_encodings", "column_sizes"))
    if not (isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)) or not (
        len(names) == len(encodings) == len(sizes)
    ):
        raise SourceError(f"{where}: column_names / column_encodings / column_sizes missing or unequal")
    for name, enc, size in zip(names, encodings, sizes, strict=True):
        if not isinstance(name, str) or not name or not isinstance(enc, str):
            raise SourceError(f"{where}: column names and encodings must be non-empty strings")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise SourceError(f"{where}: column {name!r} size must be a byte count or null, got {size!r}")
        base = enc.split(":", 1)[0]
        if enc in _REFUSED or base in _REFUSED:
            raise SourceError(f"{where}: column {name!r} ({enc}) holds {_REFUSED.get(enc) or _REFUSED[base]}")
        if base not in (*_SCALARS, *_BYTE_ENCODINGS, "str", "int", "ndarray", "json", "pil",
                        "str_int", "str_float", "str_decimal"):  # fmt: skip
            raise SourceError(f"{where}: column {name!r} has unknown MDS encoding {enc!r}")
    if len(set(names)) != len(names):
        raise SourceError(f"{where}: column names repeat: {names}")
    return tuple(zip(names, encodings, sizes, strict=True))


def decode_mds_sample(columns: Sequence[Column], data: bytes, where: str) -> dict[str, Any]:
    """One sample's bytes -> ``{column: value}``; ValueError (or struct.error) for bytes that do
    not hold the columns."""
    variable = [c for c in columns if c[2] is None]
    pos = 4 * len(variable)
    if len(data) < pos:
        raise ValueError("shorter than its size header")
    var_sizes = iter(struct.unpack_from(f"<{len(variable)}I", data, 0))
    out: dict[str, Any] = {}
    for name, encoding, size in columns:
        n = next(var_sizes) if size is None else int(size)
        if pos + n > len(data):
            raise ValueError(f"column {name!r} runs past the sample's end")
        out[name] = _decode_cell(encoding, data[pos : pos + n], f"{where} column {name!r}")
        pos += n
    return out


class MDSSource(OffsetTableSource):
    """The samples of an MDS dataset directory, in shard order; keys are the global sample
    number (zero-padded) unless a ``__key__`` / ``key`` column names them."""

    kind = "mds"

    def __init__(self, root: str | Path, *, on_error: str = "raise") -> None:
        super().__init__(str(root), on_error=on_error)
        index_path, index = self._read_index(INDEX_NAME, "MDS")
        shards = mds_shards(index, self.root, index_path)
        self.files = [s.file for s in shards]
        self._columns = [s.columns for s in shards]

    def decode(self, fi: int, data: bytes, where: str) -> dict[str, Any]:
        return decode_mds_sample(self._columns[fi], data, where)


def _decode_cell(encoding: str, cell: bytes, where: str) -> Any:
    base, _, args = encoding.partition(":")
    if base in _BYTE_ENCODINGS:
        return cell
    if base in ("str", "json", "str_decimal"):  # text kept as written (json: not re-serialised)
        return cell.decode("utf-8")
    if base == "int":
        return int(np.frombuffer(cell, np.int64, count=1)[0])
    if base in _SCALARS:
        return np.frombuffer(cell, _SCALARS[base], count=1)[0].item()
    if base == "str_int":
        return int(cell.decode("utf-8"))
    if base == "str_float":
        return float(cell.decode("utf-8"))
    if base == "pil":
        return image_array(cell, where)
    return _ndarray(cell, args, where)


def _ndarray(cell: bytes, args: str, where: str) -> np.ndarray:
    """MDS ``ndarray[:dtype[:shape]]``: a missing dtype is a 1-byte code before the data, a
    missing shape a byte ``ndim << 2 | shape dtype code`` then the dims."""
    parts = args.split(":") if args else []
    dtype = parts[0] if parts else None
    shape = tuple(int(d) for d in parts[1].split(",")) if len(parts) > 1 else None
    pos = 0
    if not dtype:
        dtype = _ND_VALUE.get(cell[0])
        if dtype is None:
            raise ValueError(f"{where}: unknown ndarray dtype code {cell[0]}")
        pos = 1
    if shape is None:
        ndim, code = cell[pos] >> 2, cell[pos] & 3
        shape_dtype = np.dtype(_ND_SHAPE[code])
        shape = tuple(int(d) for d in np.frombuffer(cell, shape_dtype, count=ndim, offset=pos + 1))
        pos += 1 + ndim * shape_dtype.itemsize
    values = np.frombuffer(cell, np.dtype(dtype), offset=pos)
    if values.size != math.prod(shape):
        raise ValueError(f"{where}: ndarray of shape {shape} holds {values.size} values")
    return values.reshape(shape).copy()


__all__ = ["INDEX_NAME", "MDSShard", "MDSSource", "decode_mds_sample", "is_mds_index", "mds_shards"]
