"""Shard formats through one registry (``shards/formats.py``; issue 23, Build item 6).

A new format is one file and one registration line: here the file is this module's "rawcat" (a
shard is its samples' field bytes end to end, with a JSON offsets sidecar beside it), registered
by one ``register_format`` call, and it is written, opened, read back byte for byte, verified
and rewritten through the public paths, with no other change to the package. A name nobody
registered is an error naming where it came from and the formats there are (before, a third
format silently took the Arrow branch), and no module outside the format files branches on a
format's name.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest

from stallfree.cache.expect import raw_check
from stallfree.errors import (
    CorruptShardError,
    HashMismatchError,
    IndexMismatchError,
    ManifestError,
    WriteError,
)
from stallfree.shards import formats
from stallfree.shards.formats import (
    ScannedFiles,
    ShardCheck,
    ShardOpen,
    UnknownFormatError,
    get_format,
    register_format,
)
from stallfree.shards.manifest.model import FORMAT_VERSION, Manifest, ShardInfo
from stallfree.shards.open import ShardedDataset, open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.shards.verify import verify_dataset
from stallfree.shards.verify_report import KeyAt, VerifyReport
from stallfree.shards.writer import ShardWriter

KEY = "__key__"
ROOT = Path(__file__).resolve().parents[2] / "stallfree"


# -- the toy format: everything a format is, in one place -------------------------------------------
def offsets_path(path: str) -> str:
    """``d/shard-000000.rawcat`` -> ``d/shard-000000.offsets.json``."""
    return path[: -len(".rawcat")] + ".offsets.json"


@dataclass(frozen=True)
class RawRow:
    sample: dict[str, bytes]
    nbytes: int


class RawcatWriter:
    field_types = None
    schema = None

    def __init__(self, path: str, fs: fsspec.AbstractFileSystem) -> None:
        self.path, self.fs, self.name = path, fs, posixpath.basename(path)
        self._data = bytearray()
        self._rows: list[dict[str, Any]] = []
        self._fields: dict[str, None] = {}
        self.info: ShardInfo | None = None

    @property
    def samples(self) -> int:
        return len(self._rows)

    @property
    def bytes(self) -> int:
        return len(self._data)

    @property
    def fields(self) -> list[str]:
        return list(self._fields)

    def write(self, sample: dict[str, Any]) -> int:
        return self.write_prepared(RAWCAT.prepare(sample))

    def write_prepared(self, row: RawRow) -> int:
        start = len(self._data)
        members = []
        for name, value in row.sample.items():
            if name != KEY:
                members.append([name, len(self._data), len(value)])
                self._data += value
                self._fields.setdefault(name, None)
        self._rows.append({"key": row.sample[KEY], "members": members})
        return len(self._data) - start

    def close(self) -> ShardInfo:
        if self.info is None:
            self.fs.pipe_file(offsets_path(self.path), json.dumps(self._rows).encode())
            self.fs.pipe_file(self.path, bytes(self._data))  # the shard last, as tar does
            digest = hashlib.sha256(self._data).hexdigest()
            self.info = ShardInfo(self.name, len(self._rows), len(self._data), digest)
        return self.info

    def abort(self) -> None:
        self._data.clear()  # nothing reaches storage before close


class RawcatReader:
    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, info: ShardInfo) -> None:
        self.fs, self.path, self.info = fs, path, info
        self.rows = json.loads(fs.cat_file(offsets_path(path)))
        size = fs.size(path)
        if size != info.bytes:
            raise CorruptShardError(f"holds {size} bytes, the manifest says {info.bytes}", shard=info.path)

    def __len__(self) -> int:
        return len(self.rows)

    def key_of(self, row: int) -> str:
        return self.rows[row]["key"]

    def get(self, row: int) -> dict[str, Any]:
        members = self.rows[row]["members"]
        lo, hi = members[0][1], members[-1][1] + members[-1][2]
        data = self.fs.cat_file(self.path, start=lo, end=hi)
        return {KEY: self.rows[row]["key"], **{n: data[o - lo : o - lo + s] for n, o, s in members}}

    def get_many(self, rows: list[int]) -> list[dict[str, Any]]:
        return [self.get(r) for r in rows]

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        return (self.get(r) for r in range(len(self.rows)))

    def close(self) -> None:
        pass


class RawcatFormat:
    name = "rawcat"
    suffix = ".rawcat"
    scan_suffixes: tuple[str, ...] = ()  # always opened through its manifest
    shard_overhead = 0
    checksums = None
    typed_fields = False
    indexable = False

    def sidecars(self, path: str, with_checksums: bool = True) -> list[str]:
        return [offsets_path(path)]

    def item_cost(self, sizes: Sequence[int]) -> int:
        return sum(sizes)

    def prepare(self, sample: dict[str, Any]) -> RawRow:
        key = sample.get(KEY)
        if not isinstance(key, str) or not key:
            raise WriteError(f"a rawcat sample needs a str {KEY}")
        values = {n: v for n, v in sample.items() if n != KEY}
        if not values or not all(isinstance(v, bytes) for v in values.values()):
            raise WriteError("a rawcat sample holds one or more bytes fields", key=key)
        return RawRow({KEY: key, **values}, sum(len(v) for v in values.values()))

    def writer(
        self, path: str, fs: fsspec.AbstractFileSystem, *, schema: Any = None, overlap_hash: bool = False
    ) -> RawcatWriter:
        return RawcatWriter(path, fs)

    def source_schema(self, source: Any) -> None:
        return None

    def open_reader(self, request: ShardOpen) -> RawcatReader:
        return RawcatReader(request.fs, request.path, request.info)

    def verify(self, check: ShardCheck, report: VerifyReport) -> list[KeyAt]:
        info, shard = check.info, check.info.path
        data = check.fs.cat_file(check.path)
        report.bytes += len(data)
        digest = hashlib.sha256(data).hexdigest()
        if check.hashes and info.sha256 is not None and digest != info.sha256:
            report.errors.append(
                HashMismatchError(f"sha256 {digest} differs from the manifest's", shard=shard)
            )
        rows = json.loads(check.fs.cat_file(offsets_path(check.path)))
        for r in rows:
            for name, off, size in r["members"]:
                if off + size > len(data):
                    report.errors.append(
                        CorruptShardError(f"{name} runs past the end", shard=shard, key=r["key"])
                    )
        if len(rows) != info.samples:
            report.errors.append(
                IndexMismatchError(f"{len(rows)} samples, manifest says {info.samples}", shard=shard)
            )
        report.samples += len(rows)
        return [(r["key"], r["members"][0][1]) for r in rows]

    def scan(self, fs: fsspec.AbstractFileSystem, root: str, paths: list[str]) -> ScannedFiles:
        raise AssertionError("never called: no scan_suffixes")


RAWCAT = RawcatFormat()


@pytest.fixture
def rawcat():
    register_format("rawcat", RAWCAT)  # the one registration line
    yield RAWCAT
    formats.unregister_format("rawcat")


def _samples(n: int, salt: str = "") -> list[dict[str, Any]]:
    return [
        {
            KEY: f"s{i:03d}",
            "bin": hashlib.sha256(f"{salt}{i}".encode()).digest() * (i + 1),
            "txt": f"t{i}".encode(),
        }
        for i in range(n)
    ]


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# -- a new format through the public paths ----------------------------------------------------------
def test_a_registered_format_is_written_opened_read_back_and_verified(rawcat, tmp_path):
    dst = tmp_path / "ds"
    samples = _samples(10)
    with ShardWriter(str(dst), format="rawcat", max_samples=4) as w:
        for sample in samples:
            w.write(sample)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest["format"] == "rawcat" and "checksums" not in manifest and "field_types" not in manifest
    assert [s["samples"] for s in manifest["shards"]] == [4, 4, 2]
    assert _files(dst) == sorted(
        ["manifest.json"] + [f"shard-00000{i}{ext}" for i in range(3) for ext in (".rawcat", ".offsets.json")]
    )

    ds = open_dataset(str(dst))
    assert isinstance(ds, ShardedDataset) and ds.format == "rawcat" and len(ds) == 10
    assert [ds[i] for i in range(10)] == samples  # byte-equal, field by field
    assert list(ds) == samples
    assert ds.get_many([9, 0, 5, 4]) == [samples[9], samples[0], samples[5], samples[4]]
    assert [ds.key_of(i) for i in range(10)] == [s[KEY] for s in samples]
    assert ds.verify() == []
    assert verify_dataset(str(dst)).ok

    check = raw_check(ds)  # the cache's check asks the format: every field bytes
    assert check.default_types == (bytes,) and check.fields == frozenset({"bin", "txt"})

    shard = dst / "shard-000001.rawcat"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    found = verify_dataset(str(dst))
    assert [(type(e), e.shard) for e in found.errors] == [(HashMismatchError, "shard-000001.rawcat")]


def test_a_rewrite_replaces_the_new_formats_sidecars_too(rawcat, tmp_path):
    """The manifest asks the format which files belong to a shard: a rewrite writes beside the old
    dataset without touching its offsets files, and removes them once the new one is committed."""
    dst = tmp_path / "ds"
    with ShardWriter(str(dst), format="rawcat", max_samples=4) as w:
        for sample in _samples(6):
            w.write(sample)
    new = _samples(3, salt="new")
    with ShardWriter(str(dst), format="rawcat", max_samples=4) as w:
        for sample in new:
            w.write(sample)
    assert _files(dst) == ["manifest.json", "shard-000000.g1.offsets.json", "shard-000000.g1.rawcat"]
    assert list(open_dataset(str(dst))) == new


def test_shard_dataset_writes_the_new_format_with_worker_processes(rawcat, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(9):
        (src / f"k{i}.bin").write_bytes(bytes([i]) * (100 + i))
        (src / f"k{i}.txt").write_bytes(f"text {i}".encode())
    source = open_source(str(src))
    expected = list(source.read_many(source.items()))
    summary = shard_dataset(
        source, str(tmp_path / "out"), format="rawcat", max_samples=2, workers=2, shuffle_seed=None
    )
    assert summary.manifest.format == "rawcat" and len(summary.manifest.shards) == 5
    ds = open_dataset(str(tmp_path / "out"))
    assert list(ds) == expected and len(expected) == 9
    assert verify_dataset(str(tmp_path / "out")).ok


def test_register_format_refuses_a_taken_name_and_a_misnamed_format(rawcat):
    with pytest.raises(ValueError, match="'rawcat' is already registered"):
        register_format("rawcat", RAWCAT)
    with pytest.raises(ValueError, match="registered as 'other' calls itself 'rawcat'"):
        register_format("other", RAWCAT)
    with pytest.raises(TypeError, match="does not follow formats.Format"):
        register_format("other", object())  # type: ignore[arg-type]
    assert formats.format_names() == ("tar", "arrow", "rawcat")
    assert get_format("rawcat") is RAWCAT


# -- unknown names ----------------------------------------------------------------------------------
def test_an_unknown_format_names_where_it_came_from_and_the_registered_ones():
    with pytest.raises(UnknownFormatError) as info:
        get_format("zip", where="s3://b/ds/manifest.json")
    message = str(info.value)
    assert "unknown shard format 'zip'" in message and "registered formats: tar, arrow" in message
    assert info.value.shard == "s3://b/ds/manifest.json" and isinstance(info.value, ManifestError)


def test_a_manifest_of_an_unregistered_format_is_refused_when_read(tmp_path, rawcat):
    with ShardWriter(str(tmp_path / "ds"), format="rawcat") as w:
        w.write(_samples(1)[0])
    formats.unregister_format("rawcat")  # e.g. opened where the package defining it is not imported
    with pytest.raises(
        ManifestError, match=r"unknown shard format 'rawcat' \(expected one of tar, arrow\)"
    ) as info:
        open_dataset(str(tmp_path / "ds"))
    assert str(tmp_path / "ds" / "manifest.json") in str(info.value)


def test_a_dataset_of_an_unknown_format_never_reads_as_arrow(tmp_path):
    """A manifest made in code (so never checked on load) with a format nobody registered: the
    read, the verify and the cache's sample check say so, rather than taking the Arrow path."""
    manifest = Manifest(FORMAT_VERSION, "zip", ["x"], [ShardInfo("a.zip", 1, 10, None)])
    ds = ShardedDataset("mem://ds", manifest, str(tmp_path), "file://" + str(tmp_path), {})
    with pytest.raises(
        UnknownFormatError, match=r"unknown shard format 'zip' \(registered formats: tar, arrow"
    ) as info:
        ds[0]
    assert info.value.shard == "mem://ds"
    with pytest.raises(UnknownFormatError, match="'zip'"):
        ds.verify()
    assert raw_check(ds).default_types != (bytes,) and raw_check(ds).fields is None  # no format's check
    with pytest.raises(WriteError, match="unknown shard format 'zip'; choose one of tar, arrow"):
        ShardWriter(str(tmp_path / "out"), format="zip")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"a")
    with pytest.raises(ValueError, match="format must be 'tar' or 'arrow', not 'zip'"):
        shard_dataset(open_source(str(tmp_path / "src")), str(tmp_path / "out"), format="zip")
    assert not (tmp_path / "out").exists()


# -- no format branches outside the format files ----------------------------------------------------
FORMAT_FILES = {"shards/formats.py", "shards/tar/format.py", "shards/arrow/format.py"}
# Consumers that take one format only and refuse the rest (not a dispatch with a default branch).
ONE_FORMAT_CONSUMERS = {
    "harness/loaders.py": "the WebDataset adapter reads tar shards only",
    "tokens/arrow_tokens.py": "token datasets read Arrow shards' input_ids columns only",
}
_NAMES = "|".join(re.escape(n) for n in ("tar", "arrow"))
_COMPARED = re.compile(rf"""[=!]=\s*['"](?:{_NAMES})['"]|['"](?:{_NAMES})['"]\s*[=!]=""")
_LISTED = re.compile(r"""\b(?:fmt|format)\s+(?:not\s+)?in\s*[(\[{]""")  # fmt in ("tar", ...)


def format_branches(root: Path = ROOT) -> dict[str, list[str]]:
    """``file -> [line: text]`` for every comparison of a format's name outside the format files."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in FORMAT_FILES:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _COMPARED.search(line) or _LISTED.search(line):
                found.setdefault(rel, []).append(f"{n}: {line.strip()}")
    return found


def test_the_branch_finder_sees_each_shape(tmp_path):
    (tmp_path / "m.py").write_text(
        'if fmt == "tar":\n    pass\nok = x != \'arrow\'\nif "tar" == f: pass\nif format not in ("a", "b"): pass\n'
        'if kind == "jsonl": pass\nname = "tar"\n'
    )
    assert format_branches(tmp_path) == {
        "m.py": [
            '1: if fmt == "tar":',
            "3: ok = x != 'arrow'",
            '4: if "tar" == f: pass',
            '5: if format not in ("a", "b"): pass',
        ]
    }


def test_no_module_branches_on_a_format_name_outside_the_format_files():
    found = format_branches()
    assert set(found) == set(ONE_FORMAT_CONSUMERS), "\n".join(
        f"{f}:\n  " + "\n  ".join(lines) for f, lines in found.items() if f not in ONE_FORMAT_CONSUMERS
    )
    assert all(len(lines) == 1 for lines in found.values()), found
