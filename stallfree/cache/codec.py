"""Explicit, versioned byte encoding of cached values - never pickle.

A cache entry may come back from another process, another node, or a disk a crashed writer left
behind, so the decoder trusts nothing: every length is checked against the buffer, and a CRC32
over the payload catches torn or flipped bytes. Anything wrong raises ``CodecError``; the cache
turns that into a miss and deletes the entry.

Layout (little-endian)::

    header  = magic b"SFcv" | version u8 | type u8 | flags u16 | crc32(payload) u32 | len(payload) u64
    bytes   : the bytes
    array   : len(dtype) u8 | dtype.str ascii | ndim u8 | shape u64 * ndim | C-order buffer
    dict    : count u32 | per field: len(name) u16 | name utf-8 | tag u8 | len u64 | value
              tags: b bytes, s str (utf-8), i int64, I big int (decimal ascii), f float64,
                    ? bool, n None, a array (as above), j list/tuple/dict as JSON text
                    (JSON values only; a tuple comes back as a list)
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import numpy as np

MAGIC = b"SFcv"
VERSION = 1

_HEADER = struct.Struct("<4sBBHIQ")
HEADER_SIZE = _HEADER.size

_T_BYTES, _T_ARRAY, _T_DICT = 1, 2, 3
_FIELD = struct.Struct("<BQ")  # tag, length
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class CodecError(ValueError):
    """A value cannot be encoded, or a cached blob is not a valid, intact entry."""


# -- encoding ---------------------------------------------------------------------------------


def encode(value: Any) -> bytes:
    """Encode a sample dict, bytes-like, or numpy array into one self-checking blob."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _frame(_T_BYTES, [bytes(value)])
    if isinstance(value, np.ndarray):
        return _frame(_T_ARRAY, _array_parts(value))
    if isinstance(value, dict):
        return _frame(_T_DICT, _dict_parts(value))
    raise CodecError(f"cannot cache a value of type {type(value).__name__} (want dict, bytes or ndarray)")


def _frame(type_tag: int, parts: list[bytes | memoryview]) -> bytes:
    crc = 0
    length = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
        length += len(part) if isinstance(part, bytes) else part.nbytes
    return b"".join([_HEADER.pack(MAGIC, VERSION, type_tag, 0, crc, length), *parts])


def _array_parts(arr: np.ndarray) -> list[bytes | memoryview]:
    if arr.dtype.hasobject:
        raise CodecError(f"cannot cache an array of dtype {arr.dtype} (object arrays need pickle)")
    dtype = arr.dtype.str.encode("ascii")
    if len(dtype) > 255 or arr.ndim > 255:
        raise CodecError(f"array dtype {arr.dtype} / ndim {arr.ndim} out of range")
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
    head = struct.pack(f"<B{len(dtype)}sB{arr.ndim}Q", len(dtype), dtype, arr.ndim, *arr.shape)
    return [head, memoryview(arr).cast("B") if arr.size else b""]


def _dict_parts(sample: dict) -> list[bytes | memoryview]:
    parts: list[bytes | memoryview] = [_U32.pack(len(sample))]
    for name, value in sample.items():
        if not isinstance(name, str):
            raise CodecError(f"sample field names must be str, got {type(name).__name__}")
        bname = name.encode("utf-8")
        if len(bname) > 0xFFFF:
            raise CodecError(f"field name too long: {name[:40]!r}...")
        tag, body = _field(name, value)
        length = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in body)
        parts += [_U16.pack(len(bname)), bname, _FIELD.pack(tag, length), *body]
    return parts


def _field(name: str, value: Any) -> tuple[int, list[bytes | memoryview]]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ord("b"), [bytes(value)]
    if isinstance(value, str):
        return ord("s"), [value.encode("utf-8")]
    if isinstance(value, (bool, np.bool_)):
        return ord("?"), [b"\x01" if value else b"\x00"]
    if isinstance(value, (int, np.integer)):
        value = int(value)
        if _INT64_MIN <= value <= _INT64_MAX:
            return ord("i"), [_I64.pack(value)]
        return ord("I"), [str(value).encode("ascii")]
    if isinstance(value, (float, np.floating)):
        return ord("f"), [_F64.pack(float(value))]
    if value is None:
        return ord("n"), []
    if isinstance(value, np.ndarray):
        return ord("a"), _array_parts(value)
    if isinstance(value, (list, tuple, dict)):
        try:
            text = json.dumps(value, allow_nan=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise CodecError(f"cannot cache field {name!r}: {exc}") from exc
        return ord("j"), [text.encode("utf-8")]
    raise CodecError(f"cannot cache field {name!r} of type {type(value).__name__}")


# -- decoding ---------------------------------------------------------------------------------


def decode(blob: bytes | bytearray | memoryview) -> Any:
    """Decode a blob from ``encode``; raises ``CodecError`` on any damage or unknown version."""
    view = memoryview(blob).cast("B")
    if len(view) < HEADER_SIZE:
        raise CodecError(f"entry too short for a header ({len(view)} bytes)")
    magic, version, type_tag, _flags, crc, length = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise CodecError(f"unknown codec version {version} (this build reads {VERSION})")
    payload = view[HEADER_SIZE:]
    if len(payload) != length:
        raise CodecError(f"payload is {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise CodecError("checksum mismatch")
    try:
        if type_tag == _T_BYTES:
            return payload.tobytes()
        if type_tag == _T_ARRAY:
            return _read_array(payload)
        if type_tag == _T_DICT:
            return _read_dict(payload)
    except (struct.error, UnicodeDecodeError, TypeError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"malformed payload: {exc}") from exc
    raise CodecError(f"unknown value type {type_tag}")


def _read_array(buf: memoryview) -> np.ndarray:
    (n,) = struct.unpack_from("<B", buf, 0)
    dtype = np.dtype(bytes(buf[1 : 1 + n]).decode("ascii"))
    if dtype.hasobject:
        raise CodecError(f"object dtype {dtype} in cache entry")
    pos = 1 + n
    (ndim,) = struct.unpack_from("<B", buf, pos)
    shape = struct.unpack_from(f"<{ndim}Q", buf, pos + 1)
    pos += 1 + 8 * ndim
    count = int(np.prod(shape, dtype=np.uint64)) if ndim else 1
    if len(buf) - pos != count * dtype.itemsize:
        raise CodecError(
            f"array buffer is {len(buf) - pos} bytes, shape {shape} of {dtype} needs more or less"
        )
    # copy: the caller owns a writable array, independent of the cache's buffer
    return np.frombuffer(buf, dtype=dtype, count=count, offset=pos).reshape(shape).copy()


def _read_dict(buf: memoryview) -> dict[str, Any]:
    (count,) = _U32.unpack_from(buf, 0)
    pos = _U32.size
    out: dict[str, Any] = {}
    for _ in range(count):
        (nlen,) = _U16.unpack_from(buf, pos)
        pos += _U16.size
        name = bytes(buf[pos : pos + nlen]).decode("utf-8")
        pos += nlen
        tag, length = _FIELD.unpack_from(buf, pos)
        pos += _FIELD.size
        if pos + length > len(buf):
            raise CodecError(f"field {name!r} runs past the end of the entry")
        body = buf[pos : pos + length]
        pos += length
        out[name] = _read_field(name, tag, body)
    if pos != len(buf):
        raise CodecError(f"{len(buf) - pos} trailing bytes after {count} fields")
    return out


def _read_field(name: str, tag: int, body: memoryview) -> Any:
    t = chr(tag)
    if t == "b":
        return body.tobytes()
    if t == "s":
        return bytes(body).decode("utf-8")
    if t == "i":
        return _I64.unpack(body)[0]
    if t == "I":
        return int(bytes(body).decode("ascii"))
    if t == "f":
        return _F64.unpack(body)[0]
    if t == "?":
        if len(body) != 1:
            raise CodecError(f"bool field {name!r} has {len(body)} bytes")
        return body[0] != 0
    if t == "n":
        if len(body):
            raise CodecError(f"None field {name!r} has a body")
        return None
    if t == "a":
        return _read_array(body)
    if t == "j":
        try:
            return json.loads(bytes(body).decode("utf-8"))
        except json.JSONDecodeError as exc:
            raise CodecError(f"field {name!r} is not valid JSON: {exc}") from exc
    raise CodecError(f"field {name!r} has unknown tag {tag}")
