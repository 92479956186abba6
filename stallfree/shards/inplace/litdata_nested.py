"""LitData's ``json`` leaves (a list, or a dict under a list, in a sample) as JSON text.

Why: since litdata 0.2.6x ``optimize()`` stores a list in a sample as one leaf of serializer
``json``: a compact binary form (a tag byte, then the value: homogeneous lists of str / int64 /
float64 / bool as arrays, lists of flat records column by column, dicts key by key) or, for
anything else and in older files, JSON text. A dataset with any list field was refused before.
We hand such a leaf on as JSON text (UTF-8, compact), as an MDS ``json`` cell is: one byte field
the cache and tar shards carry unchanged and ``json.loads`` reads back.

The bytes come from a dataset, so every count is checked against what is left of the leaf before
anything is allocated, nesting is bounded, and damage is a ``ValueError`` saying what and where
in the leaf (the caller adds the file, sample and offset). Nothing is unpickled.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

MAX_DEPTH = 64  # dicts and lists inside one another; deeper is not a dataset's
_TEXT_START = 0x20  # a first byte above this: the leaf is JSON text, not the binary form

# tag byte -> what follows (litdata.streaming.serializers' nested layout)
_JSON, _STRS, _I64S, _F64S, _BOOLS, _DICT, _RECS, _STR, _I64, _F64, _BOOL, _NONE = range(12)
# a record field's kind byte (inside _RECS)
_REC_NONE, _REC_STR, _REC_I64, _REC_F64, _REC_BOOL = range(0x10, 0x15)


def nested_leaf_json(cell: bytes) -> str:
    """A ``json`` leaf's bytes -> the value as JSON text; ValueError for bytes that are neither
    the binary form nor JSON (cut short, trailing bytes, an unknown tag, too deep)."""
    if not cell or cell[0] > _TEXT_START:
        return _json_text(bytes(cell), "the leaf")
    reader = _Reader(cell)
    value = reader.value(0)
    if reader.pos != len(cell):
        raise ValueError(f"{len(cell) - reader.pos} byte(s) after the value at byte {reader.pos}")
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:  # (JSON cells nested under the binary form's own levels)
        raise ValueError("the value is nested too deeply to write as JSON") from None


def _json_text(data: bytes, what: str) -> str:
    """``data`` checked to be JSON (bounded depth) and returned as the text it is."""
    try:
        text = data.decode("utf-8")
        json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{what} is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    return text


class _Reader:
    """A cursor over one leaf; every read checks the leaf holds it."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise ValueError(f"{what} of {n} byte(s) at byte {self.pos} runs past the leaf's end")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def count(self, what: str, min_bytes_each: int) -> int:
        """A u32 item count, refused when its items could not fit in what is left."""
        n = self.u32(f"{what} count")
        if n * min_bytes_each > len(self.data) - self.pos:
            raise ValueError(f"{what} of {n} item(s) at byte {self.pos} cannot fit in the leaf")
        return n

    def text(self, what: str) -> str:
        raw = self.take(self.u32(f"{what} length"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} ending at byte {self.pos} is not UTF-8") from None

    def array(self, dtype: str, what: str) -> list:
        n = self.count(what, 8)
        return np.frombuffer(self.take(8 * n, what), dtype).tolist()

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} deep at byte {self.pos}")
        at = self.pos
        tag = self.take(1, "tag")[0]
        if tag == _JSON:
            return json.loads(_json_text(self.take(self.u32("JSON length"), "JSON"), f"JSON at byte {at}"))
        if tag == _STRS:
            return [self.text("string") for _ in range(self.count("string list", 4))]
        if tag == _I64S:
            return self.array("<i8", "int64 list")
        if tag == _F64S:
            return self.array("<f8", "float64 list")
        if tag == _BOOLS:
            return [b != 0 for b in self.take(self.count("bool list", 1), "bool list")]
        if tag == _DICT:
            n = self.count("dict", 5)
            return {self.text("key"): self.value(depth + 1) for _ in range(n)}
        if tag == _RECS:
            return self.records()
        if tag == _STR:
            return self.text("string")
        if tag == _I64:
            return struct.unpack("<q", self.take(8, "int64"))[0]
        if tag == _F64:
            return struct.unpack("<d", self.take(8, "float64"))[0]
        if tag == _BOOL:
            return self.take(1, "bool")[0] != 0
        if tag == _NONE:
            return None
        raise ValueError(f"unknown tag {tag} at byte {at}")

    def records(self) -> list[dict[str, Any]]:
        """A list of flat dicts with the same keys, stored row by row after the key names."""
        rows = self.u32("record count")
        keys = [self.text("record key") for _ in range(self.count("record keys", 4))]
        if rows and not keys:  # (litdata writes no keyless records: a count with nothing to bound it)
            raise ValueError(f"{rows} record(s) with no fields")
        if rows * len(keys) > len(self.data) - self.pos:  # each field takes at least its kind byte
            raise ValueError(f"{rows} record(s) of {len(keys)} field(s) cannot fit in the leaf")
        return [{key: self.record_field() for key in keys} for _ in range(rows)]

    def record_field(self) -> Any:
        at = self.pos
        kind = self.take(1, "record field kind")[0]
        if kind == _REC_NONE:
            return None
        if kind == _REC_STR:
            return self.text("record string")
        if kind == _REC_I64:
            return struct.unpack("<q", self.take(8, "record int64"))[0]
        if kind == _REC_F64:
            return struct.unpack("<d", self.take(8, "record float64"))[0]
        if kind == _REC_BOOL:
            return self.take(1, "record bool")[0] != 0
        raise ValueError(f"unknown record field kind {kind} at byte {at}")


__all__ = ["MAX_DEPTH", "nested_leaf_json"]
