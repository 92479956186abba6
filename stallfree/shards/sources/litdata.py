"""LitData ``optimize()`` output as a sharding source, read from the published layout with no
dependency on ``litdata`` (or on torch's pytree at read time).

``index.json``: ``{"chunks": [{"filename", "chunk_size", "chunk_bytes", ...}], "config": {...}}``;
the config's ``data_format`` lists one serializer name per leaf of the sample, and ``data_spec``
is the sample's structure (torch's pytree ``treespec_dumps`` JSON: a dict's keys in order, list
and tuple positions). A chunk file is an offset table (``source_offsets``); a sample is one
``uint32`` size per leaf, then the leaves' bytes.

Field names are the dict keys (nested ones joined with '.'), or positions (``0``, ``1``...) for a
tuple or list; a sample that is one value is field ``data``. Byte leaves (``bytes``, ``jpeg``,
``file:*``, ``video:*``, ``tifffile``) keep their bytes exactly; numbers, strings, numpy arrays and
tensors are decoded to values (tensors as numpy arrays); a ``json`` leaf (a list in the sample)
becomes its JSON text (``litdata_nested``). ``pickle`` leaves are refused: we never unpickle data
read from a dataset.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stallfree.shards.inplace.litdata_nested import nested_leaf_json
from stallfree.shards.sources.base import SourceError
from stallfree.shards.sources.offsets import OffsetTableSource, ShardFile, image_array, shard_path

INDEX_NAME = "index.json"
# LitData's dtype tables, by index: numpy serializer (its _NUMPY_SCTYPES order) and tensors
# (its _TORCH_DTYPES_MAPPING, aliases included); None: no plain numpy equivalent.
_NUMPY_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "complex64", "complex128", "bool")  # fmt: skip
_TENSOR_DTYPES = ("float32", "float32", "float64", "float64", "complex64", "complex64", "complex128",
                  "complex128", "float16", "float16", None, "uint8", "int8", "int16", "int16",
                  "int32", "int32", "int64", "int64", "bool")  # fmt: skip
_BYTE_LEAVES = ("bytes", "jpeg", "file", "video", "tifffile")
_SCALAR_LEAVES = {"int": np.int64, "float": np.float64, "bool": np.bool_}
_MAX_SPEC_DEPTH = 64  # a sample's structure; deeper is not a dataset's


def is_litdata_index(obj: Any) -> bool:
    return (
        isinstance(obj, dict) and isinstance(obj.get("chunks"), list) and isinstance(obj.get("config"), dict)
    )


def leaf_names(spec_text: str | None, count: int, where: str) -> list[str]:
    """Field names for the ``count`` leaves of a pytree spec (torch ``treespec_dumps`` JSON)."""
    if spec_text is None:
        if count != 1:
            raise SourceError(f"{where}: no data_spec for {count} leaves")
        return ["data"]
    try:
        spec = json.loads(spec_text)
        root = spec[1] if isinstance(spec, list) else spec
    except (ValueError, IndexError, TypeError, RecursionError) as exc:
        raise SourceError(f"{where}: unreadable data_spec: {type(exc).__name__}: {exc}") from None
    names: list[str] = []

    def walk(node: Any, prefix: str, depth: int = 0) -> None:
        if not isinstance(node, dict):
            raise SourceError(f"{where}: data_spec node is {type(node).__name__}, not an object")
        if depth > _MAX_SPEC_DEPTH:
            raise SourceError(f"{where}: data_spec nests deeper than {_MAX_SPEC_DEPTH} levels")
        kind = node.get("type")
        children = node.get("children_spec") or []
        if not isinstance(children, list):
            raise SourceError(f"{where}: data_spec children_spec must be a list")
        if kind is None:
            names.append(prefix or "data")
            return
        if kind in ("builtins.dict", "collections.OrderedDict"):
            context = node.get("context")
            try:
                keys = json.loads(context) if isinstance(context, str) else context
            except (ValueError, RecursionError) as exc:
                raise SourceError(f"{where}: data_spec dict keys are not JSON: {exc}") from None
            if not isinstance(keys, list) or len(keys) != len(children):
                raise SourceError(f"{where}: data_spec dict keys do not match its children")
            labels = [str(k) for k in keys]
        elif kind in ("builtins.list", "builtins.tuple"):
            labels = [str(i) for i in range(len(children))]
        else:
            raise SourceError(f"{where}: data_spec node type {kind!r} is not supported (dict, list, tuple)")
        for label, child in zip(labels, children, strict=True):
            walk(child, f"{prefix}.{label}" if prefix else label, depth + 1)

    walk(root, "")
    if len(names) != count:
        raise SourceError(f"{where}: data_spec has {len(names)} leaves, data_format {count}")
    if len(set(names)) != len(names):
        raise SourceError(f"{where}: data_spec leaves do not have distinct names: {names}")
    return names


@dataclass(frozen=True)
class LitDataLayout:
    """What a LitData ``index.json`` says: each leaf's serializer and field name (dataset-wide),
    and the chunk files in order."""

    formats: tuple[str, ...]
    fields: tuple[str, ...]
    files: tuple[ShardFile, ...]


def litdata_layout(index: Any, root: str, index_path: str, *, local: bool = True) -> LitDataLayout:
    """The layout of a LitData ``index.json`` (parsed: ``index``), checked: PyTreeLoader,
    neither encrypted nor compressed, known serializers (``pickle`` refused: we never unpickle),
    chunk files inside ``root`` (``local``: no link out of it either). SourceError naming
    ``index_path`` (and the chunk's number) for anything else."""
    if not is_litdata_index(index):
        raise SourceError(f"{index_path} is not a LitData index (no 'chunks' and 'config')")
    config = index["config"]
    loader = config.get("item_loader", "PyTreeLoader")
    if loader != "PyTreeLoader":
        raise SourceError(f"{index_path}: item_loader {loader!r}; only PyTreeLoader datasets are read")
    if config.get("encryption"):
        raise SourceError(f"{index_path}: the dataset is encrypted")
    if config.get("compression"):
        raise SourceError(
            f"{index_path}: compression {config['compression']!r} is not supported; "
            "re-run optimize() without compression"
        )
    formats = config.get("data_format")
    if not isinstance(formats, list) or not formats or not all(isinstance(f, str) for f in formats):
        raise SourceError(f"{index_path}: config has no data_format (a list of serializer names)")
    for fmt in formats:
        base = fmt.split(":", 1)[0]
        if base == "pickle":
            raise SourceError(
                f"{index_path}: a leaf is pickled; stallfree never unpickles data read from a dataset"
            )
        if base not in (*_BYTE_LEAVES, *_SCALAR_LEAVES, "str", "json", "pil", "numpy", "no_header_numpy",
                        "tensor", "no_header_tensor"):  # fmt: skip
            raise SourceError(f"{index_path}: leaf format {fmt!r} is not supported")
    spec = config.get("data_spec")
    if spec is not None and not isinstance(spec, str):
        raise SourceError(f"{index_path}: data_spec must be a string (torch treespec JSON)")
    fields = leaf_names(spec, len(formats), index_path)
    files = []
    for i, chunk in enumerate(index["chunks"]):
        where = f"{index_path} chunk {i}"
        size = chunk.get("chunk_size") if isinstance(chunk, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise SourceError(f"{where}: needs a filename and an integer chunk_size")
        files.append(ShardFile(shard_path(root, chunk.get("filename"), where, local=local), size))
    return LitDataLayout(tuple(formats), tuple(fields), tuple(files))


def decode_litdata_sample(layout: LitDataLayout, data: bytes, where: str) -> dict[str, Any]:
    """One sample's bytes -> ``{field: value}``; ValueError (or struct.error) for bytes that do
    not hold the leaves."""
    n = len(layout.formats)
    pos = 4 * n
    if len(data) < pos:
        raise ValueError("shorter than its size header")
    sizes = struct.unpack_from(f"<{n}I", data, 0)
    out: dict[str, Any] = {}
    for name, fmt, size in zip(layout.fields, layout.formats, sizes, strict=True):
        if pos + size > len(data):
            raise ValueError(f"leaf {name!r} runs past the sample's end")
        out[name] = _decode_leaf(fmt, data[pos : pos + size], f"{where} leaf {name!r}")
        pos += size
    return out


class LitDataSource(OffsetTableSource):
    """The samples of a LitData dataset directory, in chunk order; keys are the global sample
    number (zero-padded) unless a ``__key__`` / ``key`` leaf names them."""

    kind = "litdata"

    def __init__(self, root: str | Path, *, on_error: str = "raise") -> None:
        super().__init__(str(root), on_error=on_error)
        index_path, index = self._read_index(INDEX_NAME, "LitData")
        self.layout = litdata_layout(index, self.root, index_path)
        self.formats = list(self.layout.formats)
        self.fields = list(self.layout.fields)
        self.files = list(self.layout.files)

    def decode(self, fi: int, data: bytes, where: str) -> dict[str, Any]:
        return decode_litdata_sample(self.layout, data, where)


def _decode_leaf(fmt: str, cell: bytes, where: str) -> Any:
    base, _, arg = fmt.partition(":")
    if base in _BYTE_LEAVES:
        return cell
    if base == "str":
        return cell.decode("utf-8")
    if base == "json":  # a list in the sample: as JSON text (litdata_nested.py)
        try:
            return nested_leaf_json(cell)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if base in _SCALAR_LEAVES:
        return np.frombuffer(cell, _SCALAR_LEAVES[base], count=1)[0].item()
    if base == "pil":
        return image_array(cell, where)
    if base == "no_header_numpy":
        return np.frombuffer(cell, _dtype(_NUMPY_DTYPES, arg, where)).copy()
    if base == "no_header_tensor":
        return np.frombuffer(cell, _dtype(_TENSOR_DTYPES, arg, where)).copy()
    table = _NUMPY_DTYPES if base == "numpy" else _TENSOR_DTYPES
    code, ndim = struct.unpack_from("<II", cell, 0)
    dtype = _dtype(table, code, where)
    if 8 + 4 * ndim > len(cell):
        raise ValueError(f"{where}: array header of {ndim} dimensions runs past the leaf's end")
    shape = struct.unpack_from(f"<{ndim}I", cell, 8)
    values = np.frombuffer(cell, dtype, offset=8 + 4 * ndim)
    if values.size != math.prod(shape):
        raise ValueError(f"{where}: array of shape {tuple(shape)} holds {values.size} values")
    return values.reshape(shape).copy()


def _dtype(table: tuple[str | None, ...], code: Any, where: str) -> np.dtype:
    try:
        name = table[int(code)]
    except (ValueError, IndexError):
        name = None
    if name is None:
        raise ValueError(f"{where}: dtype code {code!r} has no numpy equivalent")
    return np.dtype(name)


__all__ = [
    "INDEX_NAME",
    "LitDataLayout",
    "LitDataSource",
    "decode_litdata_sample",
    "is_litdata_index",
    "leaf_names",
    "litdata_layout",
]
