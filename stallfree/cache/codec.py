"""Explicit, versioned byte encoding of cached values - never pickle.

A cache entry may come back from another process, another node, or a disk a crashed writer left
behind, so the decoder trusts nothing: every length is checked against the buffer, a CRC32 over
the payload catches torn or flipped bytes, and ``Limits`` bounds what a well-framed entry may ask
for (nesting depth, sizes, counts, array dims and dtypes, decoded bytes), so a hostile entry costs
at most one bounded decode. Anything wrong raises ``CodecError`` - never another exception type -
and the cache turns that into a miss and deletes the entry. The encoder refuses what the decoder
would refuse, so nothing admitted is unreadable.

Each entry can carry its *identity*: which sample of which dataset, under which stage, it holds
(``Identity``; the cache writes one into every entry). The cache compares it with the key it
looked up, so an intact entry that is another sample's (copied or planted under this key, or
under a long key whose hash collided) is a miss, not a wrong sample served without a signing
secret (``base.BaseCache.get_many``).

Layout (little-endian)::

    header  = magic b"SFcv" | version u8 | type u8 | flags u16 | crc32(identity + payload) u32
              | len(payload) u64
    identity (flags bit 0 set): len(rest) u16 | index i64 | len(fingerprint) u16 | len(stage) u16
              | len(key) u16 | fingerprint | stage | key (utf-8; flags bit 1 set: the key is None)
    bytes   : the bytes
    array   : len(dtype) u8 | dtype.str ascii | ndim u8 | shape u64 * ndim | C-order buffer
    dict    : count u32 | per field: len(name) u16 | name utf-8 | tag u8 | len u64 | value
              tags: b bytes, s str (utf-8), i int64, I big int (decimal ascii), f float64,
                    ? bool, n None, a array (as above), j list/tuple/dict as JSON text
                    (JSON values only; a tuple comes back as a list)
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"SFcv"
VERSION = 2  # 2: the identity block (version 1 entries are refused: a miss, and deleted)

_HEADER = struct.Struct("<4sBBHIQ")
HEADER_SIZE = _HEADER.size

_T_BYTES, _T_ARRAY, _T_DICT = 1, 2, 3
_FIELD = struct.Struct("<BQ")  # tag, length
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_ID_LEN = struct.Struct("<H")
_ID_HEAD = struct.Struct("<qHHH")  # index, then the three string lengths
_F_IDENTITY, _F_NO_KEY = 1, 2

# plain numeric, bool and fixed-width string dtypes; no object, void/structured, subarray or datetime
_DTYPE = re.compile(r"[<>|=]?(?:b1|[iu][1248]|f[248]|c(?:8|16)|[SU][0-9]{1,6})")
_BIG_INT = re.compile(rb"-?[0-9]+")
_QUOTE, _OPEN_LIST, _CLOSE_LIST, _OPEN_DICT, _CLOSE_DICT = b'"[]{}'
_CONTAINER_BYTES = 64  # what one decoded JSON list/dict costs at least (counted in decoded bytes)


class CodecError(ValueError):
    """A value cannot be encoded, or a cached blob is not a valid, intact entry."""


class EntryTooLarge(CodecError):
    """A value whose entry would be (or a blob that is) over the size limit."""


class UnexpectedEntry(CodecError):
    """An intact entry that is not the one asked for: another sample, dataset or stage, or none
    said (no identity), or a value unlike the dataset's own samples (``expect.py``)."""


@dataclass(frozen=True)
class Identity:
    """Which sample an entry holds: the dataset's fingerprint, the global sample index, the stage,
    and the sample's ``__key__`` (None for values without one)."""

    fingerprint: str
    index: int
    stage: str
    key: str | None = None


@dataclass(frozen=True)
class Entry:
    """A decoded entry: its value and the identity it was written with (None if it has none)."""

    value: Any
    identity: Identity | None


@dataclass(frozen=True)
class Limits:
    """What one entry may ask of the decoder (and so what the encoder admits)."""

    max_entry_bytes: int = 2 << 30  # payload length
    max_decoded_bytes: int = 2 << 30  # all fields' decoded sizes, JSON containers counted too
    max_fields: int = 4096
    max_name_bytes: int = 1024
    max_array_ndim: int = 32
    max_json_bytes: int = 16 << 20  # all JSON fields of one entry together
    max_json_depth: int = 64
    max_json_containers: int = 1_000_000
    max_int_digits: int = 4300  # Python's own str->int limit


DEFAULT_LIMITS = Limits()


# -- encoding ---------------------------------------------------------------------------------


def encode(value: Any, limits: Limits = DEFAULT_LIMITS, identity: Identity | None = None) -> bytes:
    """Encode a sample dict, bytes-like, or numpy array into one self-checking blob, carrying
    ``identity`` when given. ``EntryTooLarge`` before anything is copied when the payload is over
    ``limits.max_entry_bytes``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _frame(_T_BYTES, [bytes(value)], limits, identity)
    if isinstance(value, np.ndarray):
        return _frame(_T_ARRAY, _array_parts(value, limits), limits, identity)
    if isinstance(value, dict):
        return _frame(_T_DICT, _dict_parts(value, limits), limits, identity)
    raise CodecError(f"cannot cache a value of type {type(value).__name__} (want dict, bytes or ndarray)")


def _frame(
    type_tag: int, parts: list[bytes | memoryview], limits: Limits, identity: Identity | None
) -> bytes:
    length = sum(_size(part) for part in parts)
    if length > limits.max_entry_bytes:
        raise EntryTooLarge(f"entry of {length} bytes is over the limit of {limits.max_entry_bytes}")
    flags = 0
    if identity is not None:
        block, flags = _identity_block(identity)
        parts = [block, *parts]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return b"".join([_HEADER.pack(MAGIC, VERSION, type_tag, flags, crc, length), *parts])


def _identity_block(identity: Identity) -> tuple[bytes, int]:
    index = identity.index
    if not isinstance(index, int) or isinstance(index, bool) or not _INT64_MIN <= index <= _INT64_MAX:
        raise CodecError(f"identity index must be an int64, got {index!r}")
    texts = [identity.fingerprint, identity.stage, identity.key or ""]
    if not all(isinstance(t, str) for t in texts):
        raise CodecError(f"identity fingerprint, stage and key must be str: {identity!r}")
    fp, stage, key = (t.encode("utf-8") for t in texts)
    rest = _ID_HEAD.pack(index, len(fp), len(stage), len(key)) + fp + stage + key
    if len(rest) > 0xFFFF:
        raise CodecError(f"identity of {len(rest)} bytes is too long for an entry")
    flags = _F_IDENTITY | (_F_NO_KEY if identity.key is None else 0)
    return _ID_LEN.pack(len(rest)) + rest, flags


def _size(part: bytes | memoryview) -> int:
    return len(part) if isinstance(part, bytes) else part.nbytes


def _array_parts(arr: np.ndarray, limits: Limits) -> list[bytes | memoryview]:
    if arr.dtype.hasobject:
        raise CodecError(f"cannot cache an array of dtype {arr.dtype} (object arrays need pickle)")
    if not _DTYPE.fullmatch(arr.dtype.str) or arr.dtype.fields is not None:
        raise CodecError(f"cannot cache an array of dtype {arr.dtype} (numeric, bool, S or U only)")
    dtype = arr.dtype.str.encode("ascii")
    if arr.ndim > limits.max_array_ndim:
        raise CodecError(f"array ndim {arr.ndim} is over the limit of {limits.max_array_ndim}")
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
    head = struct.pack(f"<B{len(dtype)}sB{arr.ndim}Q", len(dtype), dtype, arr.ndim, *arr.shape)
    return [head, memoryview(arr).cast("B") if arr.size else b""]


def _dict_parts(sample: dict, limits: Limits) -> list[bytes | memoryview]:
    if len(sample) > limits.max_fields:
        raise CodecError(f"sample has {len(sample)} fields, over the limit of {limits.max_fields}")
    parts: list[bytes | memoryview] = [_U32.pack(len(sample))]
    json_bytes = 0
    for name, value in sample.items():
        if not isinstance(name, str):
            raise CodecError(f"sample field names must be str, got {type(name).__name__}")
        bname = name.encode("utf-8")
        if len(bname) > limits.max_name_bytes:
            raise CodecError(f"field name too long: {name[:40]!r}... ({len(bname)} bytes)")
        tag, body = _field(name, value, limits)
        length = sum(_size(b) for b in body)
        if tag == ord("j"):
            json_bytes += length
            if json_bytes > limits.max_json_bytes:
                raise CodecError(f"JSON fields are over the limit of {limits.max_json_bytes} bytes")
        parts += [_U16.pack(len(bname)), bname, _FIELD.pack(tag, length), *body]
    return parts


def _field(name: str, value: Any, limits: Limits) -> tuple[int, list[bytes | memoryview]]:
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
        if value.bit_length() > limits.max_int_digits * 3:  # > 3 bits a digit: surely too long
            raise CodecError(f"cannot cache field {name!r}: integer over {limits.max_int_digits} digits")
        text = str(value).encode("ascii")
        if len(text.lstrip(b"-")) > limits.max_int_digits:
            raise CodecError(f"cannot cache field {name!r}: integer over {limits.max_int_digits} digits")
        return ord("I"), [text]
    if isinstance(value, (float, np.floating)):
        return ord("f"), [_F64.pack(float(value))]
    if value is None:
        return ord("n"), []
    if isinstance(value, np.ndarray):
        return ord("a"), _array_parts(value, limits)
    if isinstance(value, (list, tuple, dict)):
        try:
            text = json.dumps(value, allow_nan=True, separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError, RecursionError) as exc:
            raise CodecError(f"cannot cache field {name!r}: {exc}") from exc
        _json_containers(name, text, limits)  # refuse what decode would refuse
        return ord("j"), [text]
    raise CodecError(f"cannot cache field {name!r} of type {type(value).__name__}")


# -- decoding ---------------------------------------------------------------------------------


def decode(blob: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode a blob from ``encode`` to its value; raises ``CodecError`` (and nothing else) on any
    damage, unknown version, or an entry beyond ``limits``."""
    return decode_entry(blob, limits).value


def decode_entry(blob: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Entry:
    """Decode a blob from ``encode`` to its value and identity; ``CodecError`` as ``decode``."""
    try:
        return _decode(blob, limits)
    except CodecError:
        raise
    except Exception as exc:  # struct/unicode/numpy/json errors, RecursionError, MemoryError
        raise CodecError(f"malformed payload: {type(exc).__name__}: {exc}") from exc


def _decode(blob: bytes | bytearray | memoryview, limits: Limits) -> Entry:
    view = memoryview(blob).cast("B")
    if len(view) < HEADER_SIZE:
        raise CodecError(f"entry too short for a header ({len(view)} bytes)")
    magic, version, type_tag, flags, crc, length = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise CodecError(f"unknown codec version {version} (this build reads {VERSION})")
    if length > limits.max_entry_bytes:
        raise EntryTooLarge(f"entry of {length} bytes is over the limit of {limits.max_entry_bytes}")
    start = HEADER_SIZE
    if flags & _F_IDENTITY:
        if len(view) < start + _ID_LEN.size:
            raise CodecError("entry too short for its identity")
        start += _ID_LEN.size + _ID_LEN.unpack_from(view, start)[0]
    if len(view) - start != length:
        raise CodecError(f"payload is {len(view) - start} bytes, header says {length}")
    if zlib.crc32(view[HEADER_SIZE:]) != crc:
        raise CodecError("checksum mismatch")
    identity = (
        _read_identity(view[HEADER_SIZE + _ID_LEN.size : start], flags) if flags & _F_IDENTITY else None
    )
    payload = view[start:]
    if type_tag == _T_BYTES:
        return Entry(payload.tobytes(), identity)
    if type_tag == _T_ARRAY:
        return Entry(_read_array(payload, limits), identity)
    if type_tag == _T_DICT:
        return Entry(_Reader(limits).read_dict(payload), identity)
    raise CodecError(f"unknown value type {type_tag}")


def _read_identity(buf: memoryview, flags: int) -> Identity:
    if len(buf) < _ID_HEAD.size:
        raise CodecError("identity block too short")
    index, n_fp, n_stage, n_key = _ID_HEAD.unpack_from(buf, 0)
    if _ID_HEAD.size + n_fp + n_stage + n_key != len(buf):
        raise CodecError("identity block lengths do not add up")
    pos = _ID_HEAD.size
    texts = []
    for n in (n_fp, n_stage, n_key):
        texts.append(bytes(buf[pos : pos + n]).decode("utf-8"))
        pos += n
    key = None if flags & _F_NO_KEY else texts[2]
    return Identity(texts[0], index, texts[1], key)


def _read_array(buf: memoryview, limits: Limits) -> np.ndarray:
    (n,) = struct.unpack_from("<B", buf, 0)
    text = bytes(buf[1 : 1 + n]).decode("ascii")
    if not _DTYPE.fullmatch(text):
        raise CodecError(f"array dtype {text!r} is not allowed in a cache entry")
    dtype = np.dtype(text)
    if dtype.hasobject or dtype.fields is not None or dtype.shape:
        raise CodecError(f"array dtype {text!r} is not allowed in a cache entry")
    pos = 1 + n
    (ndim,) = struct.unpack_from("<B", buf, pos)
    if ndim > limits.max_array_ndim:
        raise CodecError(f"array ndim {ndim} is over the limit of {limits.max_array_ndim}")
    shape = struct.unpack_from(f"<{ndim}Q", buf, pos + 1)
    pos += 1 + 8 * ndim
    count = math.prod(shape)  # exact: a uint64 product could wrap to a small number
    if len(buf) - pos != count * dtype.itemsize:
        raise CodecError(
            f"array buffer is {len(buf) - pos} bytes, shape {shape} of {dtype} needs {count * dtype.itemsize}"
        )
    # copy: the caller owns a writable array, independent of the cache's buffer
    return np.frombuffer(buf, dtype=dtype, count=count, offset=pos).reshape(shape).copy()


class _Reader:
    """One dict entry's decode, keeping the running totals its limits bound."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.decoded = 0
        self.json_bytes = 0

    def _spend(self, nbytes: int, name: str) -> None:
        self.decoded += nbytes
        if self.decoded > self.limits.max_decoded_bytes:
            raise CodecError(f"field {name!r}: entry decodes to over {self.limits.max_decoded_bytes} bytes")

    def read_dict(self, buf: memoryview) -> dict[str, Any]:
        (count,) = _U32.unpack_from(buf, 0)
        if count > self.limits.max_fields:
            raise CodecError(f"entry has {count} fields, over the limit of {self.limits.max_fields}")
        pos = _U32.size
        out: dict[str, Any] = {}
        for _ in range(count):
            (nlen,) = _U16.unpack_from(buf, pos)
            pos += _U16.size
            if nlen > self.limits.max_name_bytes:
                raise CodecError(
                    f"field name of {nlen} bytes is over the limit of {self.limits.max_name_bytes}"
                )
            if pos + nlen > len(buf):
                raise CodecError("field name runs past the end of the entry")
            name = bytes(buf[pos : pos + nlen]).decode("utf-8")
            pos += nlen
            tag, length = _FIELD.unpack_from(buf, pos)
            pos += _FIELD.size
            if pos + length > len(buf):
                raise CodecError(f"field {name!r} runs past the end of the entry")
            if name in out:
                raise CodecError(f"field {name!r} appears twice")
            body = buf[pos : pos + length]
            pos += length
            out[name] = self.read_field(name, tag, body)
        if pos != len(buf):
            raise CodecError(f"{len(buf) - pos} trailing bytes after {count} fields")
        return out

    def read_field(self, name: str, tag: int, body: memoryview) -> Any:
        t = chr(tag)
        self._spend(len(body), name)
        if t == "b":
            return body.tobytes()
        if t == "s":
            return bytes(body).decode("utf-8")
        if t == "i":
            return _I64.unpack(body)[0]
        if t == "I":
            text = bytes(body)
            if len(text) > self.limits.max_int_digits + 1 or not _BIG_INT.fullmatch(text):
                raise CodecError(
                    f"field {name!r} is not a decimal integer of at most {self.limits.max_int_digits} digits"
                )
            return int(text)
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
            return _read_array(body, self.limits)
        if t == "j":
            return self.read_json(name, bytes(body))
        raise CodecError(f"field {name!r} has unknown tag {tag}")

    def read_json(self, name: str, text: bytes) -> Any:
        self.json_bytes += len(text)
        if self.json_bytes > self.limits.max_json_bytes:
            raise CodecError(f"field {name!r}: JSON fields are over {self.limits.max_json_bytes} bytes")
        self._spend(_CONTAINER_BYTES * _json_containers(name, text, self.limits), name)
        try:
            return json.loads(text.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            raise CodecError(f"field {name!r} is not valid JSON: {exc}") from exc


def _json_containers(name: str, text: bytes, limits: Limits) -> int:
    """How many lists/dicts ``text`` holds; ``CodecError`` when nested deeper than the limit.

    Checked before parsing, with array operations (Python's parser recurses once per level).
    Escape pairs are dropped first (``\\\\`` then ``\\"``, left to right as JSON reads them), so every
    quote left delimits a string, and a bracket is structural where an even number of quotes
    precedes it. The parser reads strings the same way, so it never nests deeper than counted here.
    """
    if not any(b in text for b in (b"[", b"{")):
        return 0
    chars = np.frombuffer(text.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    outside = (np.cumsum(chars == _QUOTE, dtype=np.uint8) & 1) == 0  # parity survives uint8 wrap
    opens = ((chars == _OPEN_LIST) | (chars == _OPEN_DICT)) & outside
    closes = ((chars == _CLOSE_LIST) | (chars == _CLOSE_DICT)) & outside
    containers = int(np.count_nonzero(opens))
    if containers > limits.max_json_containers:
        raise CodecError(
            f"field {name!r}: {containers} JSON lists/dicts, over the limit of {limits.max_json_containers}"
        )
    steps = opens[opens | closes].astype(np.int32) * 2 - 1  # +1 open, -1 close, in text order
    depth = int(np.cumsum(steps).max()) if steps.size else 0
    if depth > limits.max_json_depth:
        raise CodecError(
            f"field {name!r}: JSON nested {depth} deep, over the limit of {limits.max_json_depth}"
        )
    return containers
