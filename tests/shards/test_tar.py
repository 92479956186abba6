import hashlib
import io
import tarfile

import numpy as np
import pytest

from stallfree.errors import CorruptShardError, DuplicateKeyError, WriteError
from stallfree.shards.tar.writer import TarShardWriter, member_header, parse_header, split_name


def _write(path, samples):
    with TarShardWriter(str(path)) as w:
        for s in samples:
            w.write(s)
    return w.info


def test_members_contiguous_and_bytes_exact(tmp_path, samples):
    info = _write(tmp_path / "a.tar", samples[:4])
    assert info.path == "a.tar" and info.samples == 4
    data = (tmp_path / "a.tar").read_bytes()
    assert info.bytes == len(data)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    with tarfile.open(tmp_path / "a.tar") as t:
        members = t.getmembers()
        names = [m.name for m in members]
        assert names == [f"{s['__key__']}.{f}" for s in samples[:4] for f in ("cls", "jpg", "txt")]
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.mode == 0o644 for m in members)
        for s in samples[:4]:
            assert t.extractfile(f"{s['__key__']}.jpg").read() == s["jpg"]
            assert t.extractfile(f"{s['__key__']}.cls").read() == str(s["cls"]).encode()
            assert t.extractfile(f"{s['__key__']}.txt").read() == s["txt"].encode()


def test_byte_reproducible(tmp_path, samples):
    a = _write(tmp_path / "a.tar", samples)
    b = _write(tmp_path / "b.tar", [dict(reversed(list(s.items()))) for s in samples])
    assert a.sha256 == b.sha256
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()


def test_value_encodings(tmp_path):
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    _write(
        tmp_path / "v.tar", [{"__key__": "k", "npy": arr, "json": {"b": 1, "a": [2]}, "f": 0.5, "flag": True}]
    )
    with tarfile.open(tmp_path / "v.tar") as t:
        got = np.load(io.BytesIO(t.extractfile("k.npy").read()), allow_pickle=False)
        assert np.array_equal(got, arr) and got.dtype == np.int16
        assert t.extractfile("k.json").read() == b'{"a": [2], "b": 1}'
        assert t.extractfile("k.f").read() == b"0.5"
        assert t.extractfile("k.flag").read() == b"1"


def test_long_names_use_ustar_prefix(tmp_path):
    key = "d" * 80 + "/" + "e" * 60
    _write(tmp_path / "l.tar", [{"__key__": key, "bin": b"xyz"}])
    with tarfile.open(tmp_path / "l.tar") as t:
        assert t.getnames() == [key + ".bin"]
        assert t.extractfile(key + ".bin").read() == b"xyz"
    with pytest.raises(WriteError, match="too long"):
        member_header("x" * 300, 1)


@pytest.mark.parametrize("key", ["", "a.b", "dir/a.b", "a b", "/abs", None])
def test_bad_keys(tmp_path, key):
    with pytest.raises(WriteError):
        _write(tmp_path / "k.tar", [{"__key__": key, "bin": b"1"}])
    assert list(tmp_path.iterdir()) == []


def test_unencodable_value(tmp_path):
    with (
        pytest.raises(WriteError, match="cannot store a object"),
        TarShardWriter(str(tmp_path / "o.tar")) as w,
    ):
        w.write({"__key__": "k", "bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_duplicate_key(tmp_path, samples):
    with pytest.raises(DuplicateKeyError) as info, TarShardWriter(str(tmp_path / "d.tar")) as w:
        w.write(samples[0])
        w.write(samples[1])
        w.write(samples[0])
    assert info.value.key == "sample00000" and info.value.shard == "d.tar"
    # two samples written: 3 headers each + padded data (1 + 1000 + 9 bytes, then 1 + 1037 + 9 bytes)
    assert info.value.offset == (3 * 512 + 512 + 1024 + 512) + (3 * 512 + 512 + 1536 + 512)
    assert list(tmp_path.iterdir()) == []


def test_exception_mid_write_leaves_nothing(tmp_path, samples):
    with pytest.raises(RuntimeError), TarShardWriter(str(tmp_path / "x.tar")) as w:
        w.write(samples[0])
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_memory_fs_writer(samples):
    import fsspec

    info = _write("memory://tarw/one.tar", samples[:3])
    fs = fsspec.filesystem("memory")
    assert fs.size("/tarw/one.tar") == info.bytes
    assert fs.cat_file("/tarw/one.idx").startswith(b"v1.2 3\n")
    assert [p.rsplit("/", 1)[-1] for p in fs.ls("/tarw", detail=False)] == ["one.idx", "one.sums", "one.tar"]


def test_parse_header_checks_checksum():
    h = member_header("key.jpg", 1234)
    assert parse_header(h, 0, "s.tar") == ("key.jpg", 1234, b"0")
    bad = bytearray(h)
    bad[3] ^= 0xFF
    with pytest.raises(CorruptShardError, match="checksum") as info:
        parse_header(bytes(bad), 1024, "s.tar", key="prev")
    assert (info.value.shard, info.value.key, info.value.offset) == ("s.tar", "prev", 1024)


def test_split_name():
    assert split_name("a/b.c/key.seg.png") == ("a/b.c/key", "seg.png")
    assert split_name("noext") == ("noext", "")
