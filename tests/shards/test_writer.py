import json
import os
import tarfile

import pyarrow.ipc as ipc
import pytest

from stallfree.errors import DuplicateKeyError, WriteError
from stallfree.shards.manifest.model import Manifest
from stallfree.shards.writer import ShardWriter, parse_size

from .conftest import make_samples


def test_rolls_on_max_samples(tar_dataset, samples):
    m = Manifest.load(str(tar_dataset))
    assert [s.samples for s in m.shards] == [5, 5, 5, 5, 3]
    assert [s.path for s in m.shards] == [f"shard-{i:06d}.tar" for i in range(5)]
    assert m.fields == ["cls", "jpg", "txt"] and m.format == "tar"
    assert m.classes == ["c0", "c1", "c2", "c3", "c4"]
    for s in m.shards:
        assert os.path.getsize(tar_dataset / s.path) == s.bytes
        assert (tar_dataset / s.path.replace(".tar", ".idx")).exists()
    keys = []
    for s in m.shards:
        with tarfile.open(tar_dataset / s.path) as t:
            keys += sorted({n.split(".")[0] for n in t.getnames()})
    assert keys == [s["__key__"] for s in samples]


def test_rolls_on_max_bytes(tmp_path):
    samples = make_samples(20, size=3000)
    with ShardWriter(str(tmp_path), max_bytes=20_000) as w:
        for s in samples:
            w.write(s)
    m = w.manifest
    assert sum(s.samples for s in m.shards) == 20 and len(m.shards) > 3
    assert all(s.bytes <= 20_000 for s in m.shards)


def test_oversized_sample_gets_own_shard(tmp_path):
    with ShardWriter(str(tmp_path), max_bytes=4096) as w:
        w.write({"__key__": "big", "bin": b"x" * 10_000})
        w.write({"__key__": "small", "bin": b"y"})
    assert [s.samples for s in w.manifest.shards] == [1, 1]


def test_arrow_dataset(arrow_dataset, samples):
    m = Manifest.load(str(arrow_dataset))
    assert m.format == "arrow" and m.field_types == {"cls": "int64", "jpg": "binary", "txt": "string"}
    rows = []
    for s in m.shards:
        rows += ipc.open_file(str(arrow_dataset / s.path)).read_all().to_pylist()
    assert rows == samples


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"format": "zip"}, "unknown shard format"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"max_bytes": "1MB"}, "max_bytes"),
        ({"max_samples": -1}, "max_samples"),
        ({"name": "fixed"}, "must be relative and contain"),
        ({"name": "x-{nope}"}, "bad shard name pattern"),
    ],
)
def test_bad_settings_rejected_up_front(tmp_path, kwargs, message):
    with pytest.raises(WriteError, match=message):
        ShardWriter(str(tmp_path / "out"), **kwargs)
    assert not (tmp_path / "out").exists()


def test_unwritable_destination(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(WriteError, match="not writable"):
        ShardWriter(str(tmp_path / "file" / "ds"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that ignores permissions")
        with pytest.raises(WriteError, match="not writable"):
            ShardWriter(str(ro / "ds"))
    finally:
        ro.chmod(0o700)


def test_unwritable_http_destination():
    with pytest.raises(WriteError, match="not writable"):
        ShardWriter("http://127.0.0.1:9/nowhere")


def test_exception_mid_write_leaves_no_partial_shard(tmp_path):
    samples = make_samples(12)
    with pytest.raises(RuntimeError), ShardWriter(str(tmp_path), max_samples=5) as w:
        for s in samples[:8]:
            w.write(s)
        raise RuntimeError("source failed")
    names = sorted(os.listdir(tmp_path))
    assert names == ["shard-000000.idx", "shard-000000.sums", "shard-000000.tar"]  # finished shard only
    with tarfile.open(tmp_path / "shard-000000.tar") as t:
        assert len(t.getnames()) == 15


def test_duplicate_key_in_shard(tmp_path):
    s = make_samples(2)
    with pytest.raises(DuplicateKeyError) as info, ShardWriter(str(tmp_path)) as w:
        w.write(s[0])
        w.write(s[1])
        w.write(s[0])
    assert info.value.key == "sample00000" and info.value.shard == "shard-000000.tar"
    assert os.listdir(tmp_path) == []


def test_start_index_and_memory_fs():
    with ShardWriter("memory://sw/ds", max_samples=2, start_index=7, name="part-{index:03d}") as w:
        for s in make_samples(3):
            w.write(s)
    m = Manifest.load("memory://sw/ds")
    assert [s.path for s in m.shards] == ["part-007.tar", "part-008.tar"]
    assert json.loads(json.dumps(m.to_json()))["shards"][0]["samples"] == 2


def test_parse_size():
    assert parse_size("256MB") == 256_000_000
    assert parse_size("1GiB") == 2**30
    assert parse_size(5) == 5
    with pytest.raises(ValueError):
        parse_size("lots")
