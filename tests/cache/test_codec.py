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
    assert (magic, version, type_tag, flags, length) == (b"SFcv", 2, 1, 0, 3)
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
        (lambda b: b[:4] + bytes([1]) + b[5:], "unknown codec version 1"),
        (lambda b: b[:4] + bytes([3]) + b[5:], "unknown codec version 3"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
    ],
)
def test_damage_is_detected(mutate, message):
    blob = codec.encode({"__key__": "k", "jpg": b"\xff\xd8" * 50, "arr": np.arange(5)})
    with pytest.raises(codec.CodecError, match=message):
        codec.decode(mutate(blob))


def _frame(type_tag: int, payload: bytes) -> bytes:
    import zlib

    header = struct.pack("<4sBBHIQ", b"SFcv", codec.VERSION, type_tag, 0, zlib.crc32(payload), len(payload))
    return header + payload


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


# -- bounded decoding: a well-framed entry (valid CRC) may still be hostile --------------------


def _dict_frame(*fields: tuple[bytes, str, bytes], count: int | None = None) -> bytes:
    """A dict entry with a correct header and CRC around the given (name, tag, body) fields."""
    body = struct.pack("<I", len(fields) if count is None else count)
    for name, tag, value in fields:
        body += struct.pack("<H", len(name)) + name + struct.pack("<BQ", ord(tag), len(value)) + value
    return _frame(3, body)


def _array(dtype: bytes, shape: tuple[int, ...], buffer: bytes = b"") -> bytes:
    return struct.pack(f"<B{len(dtype)}sB{len(shape)}Q", len(dtype), dtype, len(shape), *shape) + buffer


def test_json_nested_200000_deep_is_a_codec_error_not_a_recursion_error():
    deep = b"[" * 200_000 + b"]" * 200_000
    blob = _dict_frame((b"__key__", "s", b"k"), (b"meta", "j", deep))
    with pytest.raises(codec.CodecError, match="'meta': JSON nested 200000 deep, over the limit of 64"):
        codec.decode(blob)


def test_json_depth_counts_only_structural_brackets():
    tricky = b'{"a":["[[[[", "\\\\", "\\"[[", {"b": [[]]}]}'  # brackets inside strings, escapes
    assert codec.decode(_dict_frame((b"m", "j", tricky))) == {"m": {"a": ["[[[[", "\\", '"[[', {"b": [[]]}]}}
    assert codec.decode(_dict_frame((b"m", "j", tricky)), codec.Limits(max_json_depth=5))
    with pytest.raises(codec.CodecError, match="nested 5 deep, over the limit of 4"):
        codec.decode(_dict_frame((b"m", "j", tricky)), codec.Limits(max_json_depth=4))


@pytest.mark.parametrize(
    "blob, message",
    [
        (_dict_frame(count=2**32 - 1), "4294967295 fields, over the limit of 4096"),
        (_dict_frame((b"x", "b", b"1"), (b"x", "b", b"2")), "field 'x' appears twice"),
        (_dict_frame((b"n" * 2000, "b", b"")), "field name of 2000 bytes is over the limit of 1024"),
        (_dict_frame((b"a", "a", _array(b"<f4", (1,) * 40, b"\0" * 4))), "ndim 40 is over the limit of 32"),
        (_dict_frame((b"a", "a", _array(b"|V8", (1,), b"\0" * 8))), "dtype '|V8' is not allowed"),
        (_dict_frame((b"a", "a", _array(b"(2,)<i4", (1,), b"\0" * 8))), "dtype '\\(2,\\)<i4' is not allowed"),
        (_dict_frame((b"a", "a", _array(b"<M8[ns]", (1,), b"\0" * 8))), "is not allowed"),
        (_dict_frame((b"a", "a", _array(b"|O", (1,), b"\0" * 8))), "dtype '|O' is not allowed"),
        # a shape whose uint64 product wraps to 0 must not pass as an empty array
        (_dict_frame((b"a", "a", _array(b"<f8", (2**32, 2**32)))), "needs 147573952589676412928"),
        (_dict_frame((b"i", "I", b"9" * 5000)), "at most 4300 digits"),
        (_dict_frame((b"i", "I", b"1_000")), "is not a decimal integer"),
        (_dict_frame((b"j", "j", b"[" * 10 + b"1e99999" + b"]" * 10)), None),  # inf: valid JSON
        (_dict_frame((b"j", "j", b"1" * 5000)), "not valid JSON"),  # Python's int-digits limit
        (_dict_frame((b"s", "s", b"\xff")), "malformed payload: UnicodeDecodeError"),
        (_dict_frame((b"i", "i", b"\0" * 3)), "malformed payload: error"),
    ],
    ids=lambda v: "entry" if isinstance(v, bytes) else str(v),
)
def test_hostile_but_well_framed_entries_are_codec_errors(blob, message):
    if message is None:
        assert codec.decode(blob) == {"j": [[[[[[[[[[float("inf")]]]]]]]]]]}
        return
    with pytest.raises(codec.CodecError, match=message):
        codec.decode(blob)


def test_limits_bound_entry_size_json_bytes_containers_and_decoded_bytes():
    sample = {"__key__": "k", "jpg": b"x" * 1000, "boxes": [[1, 2]] * 50}
    blob = codec.encode(sample)
    assert codec.decode(blob) == sample
    cases = [
        (codec.Limits(max_entry_bytes=500), "entry of .* bytes is over the limit of 500"),
        (codec.Limits(max_json_bytes=100), "JSON fields are over 100 bytes"),
        (codec.Limits(max_json_containers=20), "51 JSON lists/dicts, over the limit of 20"),
        (codec.Limits(max_decoded_bytes=2000), "entry decodes to over 2000 bytes"),
    ]
    for limits, message in cases:
        with pytest.raises(codec.CodecError, match=message):
            codec.decode(blob, limits)


def test_decode_raises_nothing_but_codec_error_on_any_well_framed_mutation():
    """Random byte edits with the CRC fixed up: every outcome is a value or a CodecError."""
    import zlib

    rng = np.random.default_rng(11)
    sample = {
        "__key__": "k",
        "jpg": b"\xff\xd8" * 20,
        "arr": np.arange(6, dtype="<i4").reshape(2, 3),
        "meta": {"boxes": [[1, 2], [3, 4]], "s": "x"},
        "n": None,
        "big": 2**70,
        "f": 0.5,
    }
    good = codec.encode(sample)
    outcomes = {"value": 0, "error": 0}
    for _ in range(3000):
        payload = bytearray(good[codec.HEADER_SIZE :])
        for _ in range(int(rng.integers(1, 4))):
            payload[int(rng.integers(len(payload)))] = int(rng.integers(256))
        if rng.random() < 0.2:
            payload = payload[: int(rng.integers(len(payload)))]
        header = struct.pack("<4sBBHIQ", b"SFcv", codec.VERSION, 3, 0, zlib.crc32(payload), len(payload))
        try:
            codec.decode(header + bytes(payload))
            outcomes["value"] += 1
        except codec.CodecError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0 and sum(outcomes.values()) == 3000


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value, message",
    [
        ({"j": nested(65)}, "'j': JSON nested 65 deep, over the limit of 64"),
        ({"j": nested(5000)}, "cannot cache field 'j': maximum recursion depth"),
        ({"i": 10**5000}, "cannot cache field 'i': integer over 4300 digits"),
        ({"a": np.zeros(2, "M8[D]")}, "dtype datetime64\\[D\\] \\(numeric, bool, S or U only\\)"),
        ({"a": np.zeros(2, [("x", "<i4")])}, "numeric, bool, S or U only"),
        ({"a": np.zeros((1,) * 33)}, "array ndim 33 is over the limit of 32"),
        ({f"f{i}": 1 for i in range(4097)}, "4097 fields, over the limit of 4096"),
    ],
)
def test_encode_refuses_what_decode_would_refuse(value, message):
    with pytest.raises(codec.CodecError, match=message):
        codec.encode(value)


def test_allowed_arrays_round_trip():
    for arr in [
        np.arange(4, dtype=">u2"),
        np.array([True, False]),
        np.zeros((2, 0, 3), "<f2"),
        np.array([1 + 2j], "<c16"),
        np.array([b"ab", b"c"]),
        np.array(["xy", "z"]),
        np.array(3.5),
    ]:
        out = codec.decode(codec.encode({"a": arr}))["a"]
        assert out.dtype == arr.dtype and out.shape == arr.shape and np.array_equal(out, arr)
