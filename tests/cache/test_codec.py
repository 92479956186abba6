"""The cache codec: explicit, versioned, self-checking; never pickle."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from stallfree.cache import codec


def test_header_layout_is_explicit():
    blob = codec.encode(b"abc")
    magic, version, type_tag, flags, crc, length = struct.unpack_from("<4sBBHIQ", blob)
    assert (magic, version, type_tag, flags, length) == (b"SFcv", 1, 1, 0, 3)
    assert blob[codec.HEADER_SIZE :] == b"abc"


@pytest.mark.parametrize(
    "value, message",
    [
        (np.array([object()]), "object arrays need pickle"),
        ({1: b"x"}, "field names must be str"),
        ({"x": [1, object()]}, "cannot cache field 'x': Object of type object"),
        ({"x": {1, 2}}, "cannot cache field 'x' of type set"),
        ("a string", "cannot cache a value of type str"),
        (3.5, "cannot cache a value of type float"),
    ],
)
def test_unencodable_values_raise_codec_error(value, message):
    with pytest.raises(codec.CodecError, match=message):
        codec.encode(value)


def test_a_pickle_is_not_an_entry():
    with pytest.raises(codec.CodecError, match="bad magic"):
        codec.decode(pickle.dumps({"x": b"y"}))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:10], "too short for a header"),
        (lambda b: b[:-1], "payload is"),
        (lambda b: b + b"\0", "payload is"),
        (lambda b: b"NOPE" + b[4:], "bad magic"),
        (lambda b: b[:4] + bytes([2]) + b[5:], "unknown codec version 2"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
    ],
)
def test_damage_is_detected(mutate, message):
    blob = codec.encode({"__key__": "k", "jpg": b"\xff\xd8" * 50, "arr": np.arange(5)})
    with pytest.raises(codec.CodecError, match=message):
        codec.decode(mutate(blob))


def _frame(type_tag: int, payload: bytes) -> bytes:
    import zlib

    return struct.pack("<4sBBHIQ", b"SFcv", 1, type_tag, 0, zlib.crc32(payload), len(payload)) + payload


def test_inconsistent_payloads_with_valid_checksum_are_rejected():
    # a well-framed array whose shape does not match its buffer
    bad_array = struct.pack("<B3sB1Q", 3, b"<f4", 1, 10) + b"\0" * 12
    with pytest.raises(codec.CodecError, match="array buffer is 12 bytes"):
        codec.decode(_frame(2, bad_array))
    # a dict field that claims more bytes than there are
    bad_dict = struct.pack("<I", 1) + struct.pack("<H", 1) + b"x" + struct.pack("<BQ", ord("b"), 999) + b"ab"
    with pytest.raises(codec.CodecError, match="runs past the end"):
        codec.decode(_frame(3, bad_dict))
    # an object dtype smuggled in
    obj = struct.pack("<B2sB1Q", 2, b"|O", 1, 1) + b"\0" * 8
    with pytest.raises(codec.CodecError):
        codec.decode(_frame(2, obj))
    # an unknown type and an unknown field tag
    with pytest.raises(codec.CodecError, match="unknown value type 9"):
        codec.decode(_frame(9, b""))
    bad_tag = struct.pack("<I", 1) + struct.pack("<H", 1) + b"x" + struct.pack("<BQ", ord("z"), 0)
    with pytest.raises(codec.CodecError, match="unknown tag"):
        codec.decode(_frame(3, bad_tag))


def test_numpy_scalars_become_python_values():
    out = codec.decode(codec.encode({"a": np.int64(3), "b": np.float32(0.5), "c": np.bool_(True)}))
    assert out == {"a": 3, "b": 0.5, "c": True}
    assert [type(v) for v in out.values()] == [int, float, bool]


def test_list_and_dict_fields_travel_as_json():
    sample = {"boxes": [[1, 2, 3, 4], [5.5, 6, 7, 8]], "meta": {"src": "coco", "ok": True}, "t": (1, "a")}
    assert codec.decode(codec.encode(sample)) == {**sample, "t": [1, "a"]}
