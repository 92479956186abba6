"""The binary sidecar of a big manifest (``manifest_sidecar.py``): exact round trips, damage named
by file and byte offset, a stale sidecar ignored for the JSON it no longer matches."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import zlib

import pytest

from stallfree.errors import ManifestError
from stallfree.shards.manifest import sidecar as sc
from stallfree.shards.manifest.model import FORMAT_VERSION, Manifest, ShardInfo
from stallfree.shards.open import open_dataset

HEADER, ENTRY = struct.Struct("<8sIIQQ32s"), struct.Struct("<QI")


def _sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _xxh3(i: int) -> str:
    return _sha(i)[:32]


def varied_manifest(fast: bool = True) -> Manifest:
    """Every kind of row: hashes known or not (``fast``: xxh3-128 on some), stamps, non-ASCII
    paths, an empty shard, a nested path."""
    shards = [
        ShardInfo("shard-000000.tar", 5, 1000, _sha(0), xxh3_128=_xxh3(0) if fast else None),
        ShardInfo("données/échantillon-1.tar", 7, 2048, None),
        ShardInfo("empty.tar", 0, 10240, _sha(2)),
        ShardInfo("part/one/shard.tar", 3, 999, None, stamp="etag:abc|idx:0123"),
        ShardInfo("日本/シャード.tar", 11, 4096, _sha(4), stamp="v2|é", xxh3_128=_xxh3(4) if fast else None),
    ]
    return Manifest(
        FORMAT_VERSION,
        "tar",
        ["jpg", "cls", "json"],
        shards,
        classes=["cat", "dog"],
        skipped=[{"source": "x.jpg", "error": "bad"}],
        field_types=None,
        transform={"max_side": 512, "quality": 90, "resized": 3},
        checksums="crc32",
        extra={"class_field": "cls", "note": [1, 2]},
    )


def encoded(m: Manifest) -> tuple[bytes, bytes]:
    text = m.dumps().encode()
    return sc.encode(m.to_json(), m.shards, m.fingerprint, text), text


def sections_of(data: bytes) -> list[bytes]:
    count = HEADER.unpack_from(data, 0)[2]
    start, out = HEADER.size + count * ENTRY.size, []
    for k in range(count):
        length = ENTRY.unpack_from(data, HEADER.size + k * ENTRY.size)[0]
        out.append(data[start : start + length])
        start += length
    return out


def repack(data: bytes, name: str, body: bytes) -> tuple[bytes, int]:
    """``data`` with section ``name`` replaced and the crcs made right (a sound checksum over
    unsound content: what a buggy writer would produce); also that section's first byte."""
    parts = sections_of(data)
    k = sc.SECTIONS.index(name)
    parts[k] = body
    head = data[: HEADER.size]
    directory = b"".join(ENTRY.pack(len(p), zlib.crc32(p)) for p in parts)
    start = HEADER.size + len(directory) + sum(len(p) for p in parts[:k])
    return head + directory + b"".join(parts), start


def section_start(data: bytes, name: str) -> int:
    parts = sections_of(data)
    k = sc.SECTIONS.index(name)
    return HEADER.size + len(parts) * ENTRY.size + sum(len(p) for p in parts[:k])


# -- round trip ----------------------------------------------------------------------------------
def test_round_trip_is_exact_row_by_row_and_field_by_field():
    m = varied_manifest()
    data, text = encoded(m)
    side = sc.decode(data, "/d/manifest.shards.bin", text)
    assert side is not None
    table = side.shards
    assert list(table) == list(m.shards) and table == m.shards
    assert [table[i] for i in range(-len(table), 0)] == list(m.shards)
    assert table[1:4] == list(m.shards)[1:4] and table[::-2] == list(m.shards)[::-2]
    with pytest.raises(IndexError, match="shard 5 out of range for 5 shards"):
        table[5]
    back = Manifest.from_json(side.manifest, shards=table)
    assert back.to_json() == m.to_json()
    assert back.samples == m.samples == 26 and back.bytes == m.bytes
    assert back.sample_counts() == [5, 7, 0, 3, 11]
    assert back.fingerprint == m.fingerprint  # the recorded one
    back.fields = ["jpg"]  # a changed manifest is hashed again, not given the recorded value
    assert back.fingerprint == Manifest.from_json(m.to_json() | {"fields": ["jpg"]}).fingerprint
    assert back.fingerprint != m.fingerprint


def as_format_1(data: bytes) -> bytes:
    """``data`` (format 2) as format 1 wrote it: no xxh3_128 section."""
    parts = sections_of(data)[: len(sc.SECTIONS_V1)]
    magic, _, _, n, json_size, json_sha = HEADER.unpack_from(data, 0)
    head = HEADER.pack(magic, 1, len(parts), n, json_size, json_sha)
    return head + b"".join(ENTRY.pack(len(p), zlib.crc32(p)) for p in parts) + b"".join(parts)


def test_a_format_1_sidecar_is_still_read_exactly():
    m = varied_manifest(fast=False)  # what format 1 was written from: no xxh3-128 anywhere
    data, text = encoded(m)
    side = sc.decode(as_format_1(data), "/d/manifest.shards.bin", text)
    assert side is not None and list(side.shards) == list(m.shards)
    assert all(s.xxh3_128 is None for s in side.shards)
    assert Manifest.from_json(side.manifest, shards=side.shards).fingerprint == m.fingerprint


def test_the_fast_digest_round_trips_and_is_in_the_json():
    m = varied_manifest()
    data, text = encoded(m)
    side = sc.decode(data, "/d/manifest.shards.bin", text)
    assert side is not None
    assert [s.xxh3_128 for s in side.shards] == [_xxh3(0), None, None, None, _xxh3(4)]
    rows = json.loads(text)["shards"]
    assert rows[0]["xxh3_128"] == _xxh3(0) and "xxh3_128" not in rows[1]


def test_an_empty_table_round_trips():
    m = Manifest(FORMAT_VERSION, "arrow", ["text"], [])
    data, text = encoded(m)
    side = sc.decode(data, "x", text)
    assert side is not None and list(side.shards) == [] and side.shards.total_samples == 0
    assert Manifest.from_json(side.manifest, shards=side.shards).fingerprint == m.fingerprint


def big_manifest(shards: int = 30_000) -> Manifest:
    infos = [ShardInfo(f"shard-{i:06d}.tar", 100 + i % 7, 50_000 + i, _sha(i)) for i in range(shards)]
    return Manifest(FORMAT_VERSION, "tar", ["jpg", "cls"], infos, classes=["a", "b"])


@pytest.fixture(scope="module")
def big() -> Manifest:
    return big_manifest()


def test_save_writes_a_sidecar_only_for_a_big_manifest_and_open_reads_it(tmp_path, big):
    small = varied_manifest()
    small.save(str(tmp_path / "small"))
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == ["manifest.json"]
    path = big.save(str(tmp_path / "big"))
    assert (tmp_path / "big" / "manifest.json").stat().st_size >= sc.SIDECAR_MIN_BYTES
    assert sorted(p.name for p in (tmp_path / "big").iterdir()) == ["manifest.json", "manifest.shards.bin"]
    fast = Manifest.load(path)
    parsed = Manifest.load(path, sidecar=False)
    assert isinstance(fast.shards, sc.ShardTable) and isinstance(parsed.shards, list)
    assert fast.to_json() == parsed.to_json() == big.to_json()
    assert fast.fingerprint == parsed.fingerprint == big.fingerprint
    ds = open_dataset(str(tmp_path / "big"))
    assert isinstance(ds.manifest.shards, sc.ShardTable)
    assert len(ds) == big.samples and ds.fingerprint == big.fingerprint
    assert ds.shard_sizes == [s.samples for s in big.shards]
    last = len(big.shards) - 1
    assert ds.locate(len(ds) - 1) == (last, big.shards[last].samples - 1)
    assert ds.shard_path(last) == str(tmp_path / "big" / big.shards[last].path)


def test_a_stale_sidecar_is_ignored_with_a_warning_and_the_json_wins(tmp_path, big, caplog):
    path = big.save(str(tmp_path))
    changed = Manifest.from_json(big.to_json())
    shards = list(changed.shards)
    shards[123] = ShardInfo(shards[123].path, 1, shards[123].bytes, None)
    changed.shards = shards
    changed.save(path, sidecar=False)  # a tool that rewrote manifest.json alone
    with caplog.at_level(logging.WARNING, logger="stallfree.shards.manifest.sidecar"):
        got = Manifest.load(path)
    assert isinstance(got.shards, list) and got.shards[123].samples == 1 and got.shards[123].sha256 is None
    assert got.fingerprint == changed.fingerprint != big.fingerprint
    assert any("made from another manifest.json" in r.getMessage() for r in caplog.records)
    changed.save(path)  # saving again makes the sidecar match
    again = Manifest.load(path)
    assert isinstance(again.shards, sc.ShardTable) and again.shards[123] == shards[123]


def test_a_newer_sidecar_format_is_ignored_for_the_json(tmp_path, big, caplog):
    path = big.save(str(tmp_path))
    side = tmp_path / "manifest.shards.bin"
    data = bytearray(side.read_bytes())
    struct.pack_into("<I", data, 8, sc.VERSION + 1)
    side.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="stallfree.shards.manifest.sidecar"):
        got = Manifest.load(path)
    assert isinstance(got.shards, list) and got.to_json() == big.to_json()
    assert any(f"sidecar format {sc.VERSION + 1}" in r.getMessage() for r in caplog.records)


# -- damage: named by file and offset, never wrong data -------------------------------------------
def test_a_truncated_sidecar_names_the_file_and_where_it_ends():
    data, text = encoded(varied_manifest())
    directory_end = HEADER.size + len(sc.SECTIONS) * ENTRY.size
    paths_at = section_start(data, "paths")
    cases = {
        0: "inside its 64-byte header",
        40: "inside its 64-byte header",
        HEADER.size: "inside its section directory",
        directory_end - 1: "inside its section directory",
        paths_at + 3: "inside section 'paths'",
        len(data) - 1: "inside section 'xxh3_128'",  # the last one
    }
    for cut, what in cases.items():
        with pytest.raises(ManifestError, match="/ds/manifest.shards.bin ends at byte") as err:
            sc.decode(data[:cut], "/ds/manifest.shards.bin", text)
        assert what in str(err.value) and err.value.offset == cut, cut


def test_a_flipped_byte_in_any_section_fails_its_checksum_at_that_section():
    data, text = encoded(varied_manifest())
    for name in sc.SECTIONS:
        start = section_start(data, name)
        broken = bytearray(data)
        broken[start] ^= 0x01
        with pytest.raises(ManifestError, match=f"section '{name}' .* fails its crc32") as err:
            sc.decode(bytes(broken), "/ds/manifest.shards.bin", text)
        assert err.value.offset == start and "/ds/manifest.shards.bin" in str(err.value)


def test_bad_magic_and_trailing_bytes_are_errors():
    data, text = encoded(varied_manifest())
    with pytest.raises(ManifestError, match="not a manifest sidecar") as err:
        sc.decode(b"NOTSIDE!" + data[8:], "f", text)
    assert err.value.offset == 0
    with pytest.raises(ManifestError, match="has 2 bytes after its last section") as err:
        sc.decode(data + b"xx", "f", text)
    assert err.value.offset == len(data)


def _le64(values: list[int], signed: bool = False) -> bytes:
    return struct.pack(f"<{len(values)}{'q' if signed else 'Q'}", *values)


def test_sound_checksums_over_unsound_content_are_still_refused():
    m = varied_manifest()
    data, text = encoded(m)
    samples = [s.samples for s in m.shards]
    path_bytes = [len(s.path.encode()) for s in m.shards]
    ends = [sum(path_bytes[: k + 1]) for k in range(len(path_bytes))]
    cases = [
        ("samples", _le64([samples[0], -1, *samples[2:]], signed=True), "shard 1's samples is negative", 8),
        ("flags", bytes([1, 0, 1, 2, 3 | 8]), "shard 4 has unknown flags 11", 4),
        ("path_offsets", _le64([0, ends[1], ends[0], *ends[2:]]), "does not cut 'paths'", 16),
        ("path_offsets", _le64([0, 0, *ends[1:]]), "shard 0 has an empty path", 0),
        ("path_offsets", _le64([0, *ends[:3], ends[3] + 1, ends[4]]), "cuts a character in two", 32),
        ("flags", bytes([1, 0, 1, 0, 3]), "shard 3 has a stamp that disagrees with its flag", None),
        ("samples", b"\0" * 8, "section 'samples' holds 8 bytes, 5 shards need 40", 0),
        ("meta", b"[1, 2]", "section 'meta' is not an object", 0),
        ("meta", b"{nope", "section 'meta' is not JSON", 0),
    ]
    for name, body, message, offset in cases:
        broken, start = repack(data, name, body)
        with pytest.raises(ManifestError, match="/ds/manifest.shards.bin ") as err:
            sc.decode(broken, "/ds/manifest.shards.bin", text)
        assert message in str(err.value), (name, str(err.value))
        if offset is None:  # named at the stamp's offsets, where its length is
            start, offset = section_start(broken, "stamp_offsets"), 24
        assert err.value.offset == start + offset, (name, message)
    broken, start = repack(data, "paths", b"\xff" + sections_of(data)[sc.SECTIONS.index("paths")][1:])
    with pytest.raises(ManifestError, match="section 'paths' is not UTF-8") as err:
        sc.decode(broken, "f", text)
    assert err.value.offset == start


def test_opening_through_a_damaged_sidecar_raises_rather_than_guessing(tmp_path, big):
    path = big.save(str(tmp_path))
    side = tmp_path / "manifest.shards.bin"
    data = side.read_bytes()
    start = section_start(data, "samples")
    broken = bytearray(data)
    broken[start + 8 * 77] ^= 0x40  # shard 77's count, silently different if it were trusted
    side.write_bytes(bytes(broken))
    with pytest.raises(ManifestError, match="section 'samples' .* fails its crc32") as err:
        open_dataset(str(tmp_path))
    assert str(side) in str(err.value) and err.value.offset == start
    assert "remove it to read manifest.json alone" in str(err.value)
    side.write_bytes(data[: len(data) // 2])
    with pytest.raises(ManifestError, match="truncated"):
        Manifest.load(path)
    side.unlink()  # what the message advises: the JSON alone opens
    assert Manifest.load(path).to_json() == big.to_json()


def test_the_meta_section_is_the_manifest_without_its_shards():
    m = varied_manifest()
    data, text = encoded(m)
    meta = json.loads(sections_of(data)[0])
    assert meta["fingerprint"] == m.fingerprint
    assert meta["manifest"] == {k: v for k, v in m.to_json().items() if k != "shards"}
    assert HEADER.unpack_from(data, 0)[3:] == (5, len(text), hashlib.sha256(text).digest())


@pytest.mark.parametrize(
    ("path", "problem"),
    [("/etc/passwd", "is absolute"), ("../x/shard.tar", "climbs out"), ("s3://b/shard.tar", "is a URL")],
)
def test_a_sidecar_path_out_of_the_dataset_is_refused_as_the_json_one_is(path, problem):
    """The sidecar stands for the JSON's shard list (read in its place): a path that the JSON
    would refuse is refused here, naming the entry, even under sound checksums."""
    m = varied_manifest()
    m.shards[3] = ShardInfo(path, 3, 999, None)
    data, text = encoded(m)
    with pytest.raises(ManifestError, match=f"/ds/manifest.shards.bin: shard 3 \\({path!r}\\) {problem}"):
        sc.decode(data, "/ds/manifest.shards.bin", text)
    good, text = encoded(varied_manifest())
    assert sc.decode(good, "/ds/manifest.shards.bin", text) is not None


def test_sidecar_counts_that_add_up_past_int64_are_refused():
    """Its totals are summed in int64: two shards of 2**62 samples wrapped to a negative total."""
    m = varied_manifest()
    data, text = encoded(m)
    samples = [2**62, 2**62, 0, 0, 0]
    broken, start = repack(data, "samples", _le64(samples))
    with pytest.raises(ManifestError, match="the shards' samples add up to more than a 64-bit count") as err:
        sc.decode(broken, "/ds/manifest.shards.bin", text)
    assert err.value.offset == start
