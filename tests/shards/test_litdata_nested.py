"""LitData ``json`` leaves (lists in a sample; litdata's binary nested form, or JSON text) read as
JSON text, and damaged ones refused with a ValueError rather than a crash or a huge allocation.
The form is written here byte by byte from its layout; ``test_inplace_writers.py`` reads what
``litdata.optimize`` itself writes."""

from __future__ import annotations

import json
import struct

import pytest

from stallfree.shards.inplace.litdata_nested import MAX_DEPTH, nested_leaf_json


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def text(s: str) -> bytes:
    raw = s.encode()
    return u32(len(raw)) + raw


def enc(value) -> bytes:
    """litdata's nested layout for ``value`` (tags 0-11; records 0x10-0x14)."""
    if value is None:
        return b"\x0b"
    if isinstance(value, bool):
        return b"\x0a" + bytes([value])
    if isinstance(value, str):
        return b"\x07" + text(value)
    if isinstance(value, int):
        return b"\x08" + struct.pack("<q", value)
    if isinstance(value, float):
        return b"\x09" + struct.pack("<d", value)
    if isinstance(value, dict):
        return b"\x05" + u32(len(value)) + b"".join(text(k) + enc(v) for k, v in value.items())
    if value and all(isinstance(v, str) for v in value):
        return b"\x01" + u32(len(value)) + b"".join(text(v) for v in value)
    if value and all(isinstance(v, bool) for v in value):
        return b"\x04" + u32(len(value)) + bytes(value)
    if value and all(isinstance(v, int) for v in value):
        return b"\x02" + u32(len(value)) + struct.pack(f"<{len(value)}q", *value)
    if value and all(isinstance(v, float) for v in value):
        return b"\x03" + u32(len(value)) + struct.pack(f"<{len(value)}d", *value)
    payload = json.dumps(value).encode()
    return b"\x00" + u32(len(payload)) + payload


def records(rows: list[dict]) -> bytes:
    keys = list(rows[0])
    out = b"\x06" + u32(len(rows)) + u32(len(keys)) + b"".join(text(k) for k in keys)
    return out + b"".join(record_field(row[k]) for row in rows for k in keys)


def record_field(v) -> bytes:
    if v is None:
        return b"\x10"
    if isinstance(v, str):
        return b"\x11" + text(v)
    if isinstance(v, bool):
        return b"\x14" + bytes([v])
    if isinstance(v, int):
        return b"\x12" + struct.pack("<q", v)
    return b"\x13" + struct.pack("<d", v)


@pytest.mark.parametrize(
    "value",
    [
        ["a", "\u00fc", ""],
        [],
        [1, -(2**63), 2**63 - 1],
        [0.5, -1e300],
        [True, False],
        {"k": [1, 2], "n": None, "s": "x", "f": 2.5, "b": False, "i": 7, "d": {"e": ["z"]}},
        [1, "mixed", None, {"x": [1]}],
    ],
)
def test_every_tag_reads_back_as_its_json(value):
    assert json.loads(nested_leaf_json(enc(value))) == value


def test_records_and_json_text_read_back():
    rows = [
        {"a": 1, "b": "r", "c": None, "d": 0.25, "e": True},
        {"a": -2, "b": "", "c": None, "d": 1.0, "e": False},
    ]
    assert json.loads(nested_leaf_json(records(rows))) == rows
    # older litdata wrote JSON text: kept as written
    assert nested_leaf_json(b'[1, "two", {"three": 3}]') == '[1, "two", {"three": 3}]'


def _deep(depth: int) -> bytes:
    return b"".join(b"\x05" + u32(1) + text("k") for _ in range(depth)) + b"\x0b"


@pytest.mark.parametrize(
    "cell, message",
    [
        (enc(["abc", "de"])[:-1], "runs past the leaf's end"),
        (b"\x02" + u32(2**31) + b"\x00" * 16, "cannot fit in the leaf"),  # a count no leaf could hold
        (b"\x01" + u32(2**32 - 1), "cannot fit in the leaf"),
        (b"\x06" + u32(2**32 - 1) + u32(0), "with no fields"),
        (b"\x06" + u32(2**32 - 1) + u32(1) + text("a") + b"\x12", "cannot fit in the leaf"),
        (b"\x06" + u32(1) + u32(1) + text("a") + b"\x15", "unknown record field kind 21"),
        (enc([1, 2]) + b"\x00", "1 byte(s) after the value"),
        (b"\x0c", "unknown tag 12"),
        (b"\x07" + text("x")[:4] + b"\xff", "not UTF-8"),
        (b"\x00" + u32(3) + b"[1,", "not JSON"),
        (b"[" * 100_000, "not JSON"),  # JSON text nested past the parser's recursion limit
        (b"\xff\xfe", "not JSON"),
        (_deep(MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} deep"),
    ],
)
def test_damaged_leaves_are_a_value_error_saying_what(cell, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        nested_leaf_json(cell)


def test_nesting_up_to_the_bound_reads():
    value = json.loads(nested_leaf_json(_deep(MAX_DEPTH)))
    for _ in range(MAX_DEPTH):
        value = value["k"]
    assert value is None
