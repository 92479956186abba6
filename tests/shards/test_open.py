import logging
import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest

from stallfree.errors import MissingShardError, ShardError
from stallfree.shards.manifest.model import Manifest
from stallfree.shards.open import open_dataset
from stallfree.shards.tar.idx import idx_path_for
from stallfree.shards.tar.indexing import index_tars
from stallfree.shards.writer import ShardWriter
from stallfree.storage.fs import expand_braces

from .conftest import make_samples, tar_field


def _as_tar(sample):
    return {k: (v if k == "__key__" else tar_field(v)) for k, v in sample.items()}


def test_tar_random_access(tar_dataset, samples):
    ds = open_dataset(str(tar_dataset))
    assert len(ds) == 23 and ds.shard_sizes == [5, 5, 5, 5, 3]
    assert ds.url == str(tar_dataset) and ds.manifest.classes == [f"c{i}" for i in range(5)]
    for i in (0, 4, 5, 13, 22):
        assert ds[i] == _as_tar(samples[i])
    assert ds[-1] == _as_tar(samples[-1])
    assert ds[np.int64(7)]["__key__"] == "sample00007"
    with pytest.raises(IndexError):
        ds[23]
    with pytest.raises(IndexError):
        ds[-24]


def test_iteration_and_get_many(tar_dataset, samples):
    ds = open_dataset(str(tar_dataset))
    assert list(ds) == [_as_tar(s) for s in samples]
    got = ds.get_many([22, 0, 6, 6, 5])
    assert [g["__key__"] for g in got] == [
        "sample00022",
        "sample00000",
        "sample00006",
        "sample00006",
        "sample00005",
    ]
    assert got[2] == got[3] and got[2] is not got[3]
    assert ds.get_many([]) == []


def test_arrow_types(arrow_dataset, samples):
    ds = open_dataset(str(arrow_dataset))
    assert len(ds) == 23 and ds.format == "arrow"
    assert list(ds) == samples
    assert ds.get_many([3, 1]) == [samples[3], samples[1]]


def test_arrow_arrays_come_back_as_numpy(tmp_path):
    with ShardWriter(str(tmp_path), format="arrow") as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "tokens": np.arange(i + 2, dtype=np.int32)})
    got = open_dataset(str(tmp_path))[2]["tokens"]
    assert isinstance(got, np.ndarray) and got.dtype == np.int32 and got.tolist() == [0, 1, 2, 3]


def test_arrow_without_key_column_keys_rows_by_shard_position(tmp_path):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    schema = pa.schema([("x", pa.int64())])
    with ipc.new_file(str(tmp_path / "a.arrow"), schema) as w:  # two record batches, no __key__
        w.write_batch(pa.record_batch([pa.array([0, 1, 2])], schema=schema))
        w.write_batch(pa.record_batch([pa.array([3, 4])], schema=schema))
    ds = open_dataset(str(tmp_path))
    assert [ds[i]["__key__"] for i in range(5)] == [f"a/{i}" for i in range(5)]
    assert [s["x"] for s in ds] == [0, 1, 2, 3, 4]


def test_fingerprint(tar_dataset, tmp_path):
    a, b = open_dataset(str(tar_dataset)), open_dataset(str(tar_dataset / "manifest.json"))
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 32
    with ShardWriter(str(tmp_path / "other"), max_samples=5) as w:
        for s in make_samples(23, seed=1):
            w.write(s)
    assert open_dataset(str(tmp_path / "other")).fingerprint != a.fingerprint


def test_pickle_reopens_lazily(tar_dataset, samples):
    ds = open_dataset(str(tar_dataset))
    ds[3]
    blob = pickle.dumps(ds)
    assert len(blob) < 4000  # URL, options, manifest: no mapped file contents
    back = pickle.loads(blob)
    assert back._readers == [None] * 5
    assert back[3] == ds[3] and back.fingerprint == ds.fingerprint


def _keys_in_child(ds, indices):
    return [ds[i]["__key__"] for i in indices]


def test_works_in_spawned_worker(tar_dataset):
    ds = open_dataset(str(tar_dataset))
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_keys_in_child, (ds, [0, 22])) == ["sample00000", "sample00022"]


def test_without_manifest(tar_dataset, samples, caplog):
    os.remove(tar_dataset / "manifest.json")
    expected = [_as_tar(s) for s in samples]
    for url in (
        str(tar_dataset),
        str(tar_dataset / "*.tar"),
        str(tar_dataset / "shard-{000000..000004}.tar"),
    ):
        with caplog.at_level(logging.WARNING, logger="stallfree.shards.open"):
            caplog.clear()
            ds = open_dataset(url)
        assert "stallfree index" in caplog.text and "stallfree shard" in caplog.text
        assert list(ds) == expected
        assert ds.shard_sizes == [5, 5, 5, 5, 3]
        assert pickle.loads(pickle.dumps(ds))[12] == expected[12]
    one = open_dataset(str(tar_dataset / "shard-000001.tar"))
    assert [s["__key__"] for s in one] == [f"sample{i:05d}" for i in range(5, 10)]


def test_without_idx_scans_headers(tar_dataset, samples, caplog):
    for i in range(5):
        os.remove(tar_dataset / f"shard-{i:06d}.idx")
    with caplog.at_level(logging.WARNING):
        ds = open_dataset(str(tar_dataset))
        assert ds[7] == _as_tar(samples[7])
    assert "has no .idx" in caplog.text
    problems = ds.verify(hashes=True)
    assert [str(p) for p in problems] == [
        f"missing index shard-{i:06d}.idx: no .idx file beside the shard (shard shard-{i:06d}.tar)"
        for i in range(5)
    ]


def test_index_tars_writes_same_idx_and_manifest(tar_dataset):
    originals = {i: (tar_dataset / f"shard-{i:06d}.idx").read_text() for i in range(5)}
    written = Manifest.load(str(tar_dataset))
    for i in range(5):
        os.remove(tar_dataset / f"shard-{i:06d}.idx")
    os.remove(tar_dataset / "manifest.json")
    seen = []
    summary = index_tars([str(tar_dataset)], progress=seen.append)
    assert seen == [1] * 5
    assert (summary["shards"], summary["samples"]) == (5, written.samples)
    assert {i: (tar_dataset / f"shard-{i:06d}.idx").read_text() for i in range(5)} == originals
    m = Manifest.load(summary["manifest"])
    assert [s.to_json() for s in m.shards] == [s.to_json() for s in written.shards]
    assert Manifest.load(str(tar_dataset)).fields == ["cls", "jpg", "txt"]
    assert open_dataset(str(tar_dataset)).verify() == []


def test_memory_filesystem(samples):
    with ShardWriter("memory://opends/ds", max_samples=4) as w:
        for s in samples:
            w.write(s)
    ds = open_dataset("memory://opends/ds")
    assert list(ds) == [_as_tar(s) for s in samples]
    assert ds.get_many([9, 8, 1]) == [_as_tar(samples[i]) for i in (9, 8, 1)]
    assert pickle.loads(pickle.dumps(ds))[5] == _as_tar(samples[5])
    assert ds.verify() == []


def test_missing_dataset(tmp_path):
    with pytest.raises(MissingShardError, match="no dataset"):
        open_dataset(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingShardError, match="no manifest.json and no .tar"):
        open_dataset(str(tmp_path / "empty"))
    with pytest.raises(MissingShardError, match="no files match"):
        open_dataset(str(tmp_path / "*.tar"))


def test_mixed_formats_rejected(tar_dataset, arrow_dataset):
    os.rename(arrow_dataset / "shard-000000.arrow", tar_dataset / "x.arrow")
    os.remove(tar_dataset / "manifest.json")
    with pytest.raises(ShardError, match="all .tar or all .arrow"):
        open_dataset(str(tar_dataset))


def test_expand_braces():
    assert expand_braces("d-{000..002}.tar") == ["d-000.tar", "d-001.tar", "d-002.tar"]
    assert expand_braces("{a,b}/{8..10}") == ["a/8", "a/9", "a/10", "b/8", "b/9", "b/10"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    assert idx_path_for("d-000.tar") == "d-000.idx"


def test_retain_freed_memory_is_harmless(tar_dataset, samples):
    from stallfree.loader.shm.heap import retain_freed_memory

    assert retain_freed_memory() in (True, False)  # False only off glibc
    assert open_dataset(str(tar_dataset)).get_many(range(23)) == [_as_tar(s) for s in samples]
