"""A dataset opened without a manifest is fingerprinted from what the store says identifies each
shard's content (``stamps.py``), so one changed in place is never served from a persistent cache."""

from __future__ import annotations

import logging
import os
import time

import pytest

from stallfree.cache.node import NodeCache
from stallfree.loader.dataloader import DataLoader
from stallfree.shards.manifest.model import Manifest
from stallfree.shards.open import open_dataset
from stallfree.shards.tar.idx import idx_path_for, parse_idx
from stallfree.shards.writer import ShardWriter
from stallfree.storage import stamps
from stallfree.testing.httpserve import serve_directory

N = 200


def write_tars(root, n: int = N) -> list[str]:
    """Tars with ``.idx`` and no manifest (as WebDataset users have them); labels are ``0``..``4``."""
    with ShardWriter(str(root), format="tar", max_samples=50) as w:
        for i in range(n):
            w.write({"__key__": f"s{i:04d}", "jpg": bytes([i % 256]) * 500, "cls": str(i % 5).encode()})
    (root / "manifest.json").unlink()
    return sorted(str(p) for p in root.glob("*.tar"))


def relabel_in_place(tars: list[str], keep_mtime: bool = False) -> None:
    """Every ``cls`` member rewritten in place with another one-byte label: same sizes, same
    index, the tar's bytes changed (``keep_mtime``: and its mtime set back, as some tools do)."""
    time.sleep(0.05)  # the file clock is coarse (a jiffy): let it move past the write above
    for tar in tars:
        st = os.stat(tar)
        with open(idx_path_for(tar)) as f:
            samples = parse_idx(f.read(), tar)
        with open(tar, "r+b") as f:
            for s in samples:
                for field, off, size, _ in s.members:
                    if field == "cls":
                        f.seek(off)
                        old = f.read(size)
                        f.seek(off)
                        f.write(str((int(old) + 1) % 5).encode())
        if keep_mtime:
            os.utime(tar, ns=(st.st_atime_ns, st.st_mtime_ns))


def labels(ds, cache) -> dict[str, bytes]:
    loader = DataLoader(ds, batch_size=20, cache=cache, seed=0, collate_fn=lambda b: b)
    return {s["__key__"]: s["cls"] for batch in loader for s in batch}


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["rewritten", "mtime-restored"])
def test_a_tar_relabelled_in_place_is_not_served_from_a_node_cache_on_disk(tmp_path, keep_mtime):
    tars = write_tars(tmp_path / "data")
    url = str(tmp_path / "data")
    before = open_dataset(url)
    cache_dir = tmp_path / "node"
    old = labels(before, NodeCache(cache_dir))
    assert len(old) == N
    relabel_in_place(tars, keep_mtime=keep_mtime)
    after = open_dataset(url)
    assert after.fingerprint != before.fingerprint
    assert [s.samples for s in after.manifest.shards] == [s.samples for s in before.manifest.shards]
    assert [s.bytes for s in after.manifest.shards] == [s.bytes for s in before.manifest.shards]
    new = labels(after, NodeCache(cache_dir))  # the same store on disk, a new process's view
    truth = {k: str((int(v) + 1) % 5).encode() for k, v in old.items()}
    assert new == truth  # every one of the 200 samples with its new label


def test_the_fingerprint_is_stable_while_nothing_changes_and_survives_pickling(tmp_path):
    import pickle

    write_tars(tmp_path / "data", n=20)
    a, b = open_dataset(str(tmp_path / "data")), open_dataset(str(tmp_path / "data" / "*.tar"))
    assert a.fingerprint == b.fingerprint
    assert pickle.loads(pickle.dumps(a)).fingerprint == a.fingerprint
    assert all(s.stamp and "mtime_ns=" in s.stamp and "idx=" in s.stamp for s in a.manifest.shards)


def test_an_index_rewritten_with_the_same_sizes_changes_the_fingerprint(tmp_path):
    """Keys renamed in the ``.idx`` (same lengths): the index hash changes even where the store's
    version would not (the tar is untouched)."""
    tars = write_tars(tmp_path / "data", n=10)
    before = open_dataset(str(tmp_path / "data")).fingerprint
    idx = idx_path_for(tars[0])
    text = open(idx).read()
    st = os.stat(tars[0])
    with open(idx, "w") as f:
        f.write(text.replace("jpg ", "png ").replace(".jpg", ".png"))
    os.utime(tars[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert open_dataset(str(tmp_path / "data")).fingerprint != before


def test_arrow_files_without_a_manifest_are_stamped_too(tmp_path):
    with ShardWriter(str(tmp_path / "a"), format="arrow", max_samples=5) as w:
        for i in range(10):
            w.write({"__key__": f"a{i}", "cls": i})
    (tmp_path / "a" / "manifest.json").unlink()
    before = open_dataset(str(tmp_path / "a"))
    assert all(s.stamp for s in before.manifest.shards)
    path = tmp_path / "a" / before.manifest.shards[0].path
    time.sleep(0.05)
    os.utime(path)  # touched: a rewrite the store can see
    assert open_dataset(str(tmp_path / "a")).fingerprint != before.fingerprint


def test_a_manifest_keeps_its_fingerprint_and_writes_no_stamps(tmp_path):
    """A written manifest is the content's identity (sha256 per shard): copying the dataset, to
    another node or disk, must keep its fingerprint so every node shares one cluster cache."""
    with ShardWriter(str(tmp_path / "m"), format="tar", max_samples=5) as w:
        for i in range(10):
            w.write({"__key__": f"k{i}", "cls": i})
    ds = open_dataset(str(tmp_path / "m"))
    assert all(s.stamp is None for s in ds.manifest.shards)
    assert "stamp" not in (tmp_path / "m" / "manifest.json").read_text()
    time.sleep(0.05)
    for p in (tmp_path / "m").glob("*.tar"):
        os.utime(p)
    assert open_dataset(str(tmp_path / "m")).fingerprint == ds.fingerprint


def test_stamps_round_trip_in_the_manifest_json():
    m = Manifest.from_json(
        {
            "version": 1,
            "format": "tar",
            "fields": ["cls"],
            "shards": [{"path": "a.tar", "samples": 1, "bytes": 10, "sha256": None, "stamp": "x"}],
        }
    )
    assert m.shards[0].stamp == "x" and Manifest.from_json(m.to_json()).fingerprint == m.fingerprint
    with pytest.raises(Exception, match="stamp must be a string or null"):
        Manifest.from_json({**m.to_json(), "shards": [{**m.shards[0].to_json(), "stamp": 5}]})


@pytest.mark.parametrize(
    "info, version",
    [
        ({"size": 3, "ETag": '"abc"', "LastModified": "2026-01-01"}, 'ETag="abc",LastModified=2026-01-01'),
        ({"size": 3, "generation": "17", "md5Hash": "Zm9v"}, "generation=17,md5Hash=Zm9v"),
        ({"size": 3, "etag": "0x8D", "last_modified": "t"}, "etag=0x8D,last_modified=t"),
        ({"size": 3, "ETag": "e", "Last-Modified": "Tue"}, "ETag=e,Last-Modified=Tue"),
        ({"size": 3, "name": "x", "type": "file"}, None),
    ],
    ids=["s3", "gcs", "azure", "http", "nothing"],
)
def test_what_each_store_offers_as_a_version(info, version):
    assert stamps.version_of(info) == version


def test_a_store_without_versions_is_fingerprinted_by_size_and_index_with_a_warning(tmp_path, caplog):
    """The loopback HTTP server sends neither ETag nor Last-Modified."""
    write_tars(tmp_path / "data", n=10)
    with serve_directory(tmp_path) as server, caplog.at_level(logging.WARNING):
        names = sorted(p.name for p in (tmp_path / "data").glob("*.tar"))
        url = server.url + "/data/{" + ",".join(n[:-4] for n in names) + "}.tar"
        ds = open_dataset(url)
        assert [ds[i]["__key__"] for i in (0, 9)] == ["s0000", "s0009"]
    assert "reports no version (ETag, mtime)" in caplog.text
    assert all("unversioned" in s.stamp for s in ds.manifest.shards)
