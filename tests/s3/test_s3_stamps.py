"""On S3 a dataset opened without a manifest is fingerprinted with each object's ETag, so an
object rewritten in place (same size, other bytes) changes the fingerprint (moto on loopback)."""

import fsspec

from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter


def test_an_object_rewritten_with_the_same_size_changes_the_fingerprint(s3, bucket):
    url = f"s3://{bucket}/plain"
    with ShardWriter(url, format="tar", max_samples=4, **s3.storage_options) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "cls": str(i % 2).encode()})
    fs = fsspec.filesystem("s3", **s3.storage_options)
    fs.rm(f"{bucket}/plain/manifest.json")
    before = open_dataset(url, **s3.storage_options)
    assert all("ETag=" in s.stamp for s in before.manifest.shards)
    shard = f"{bucket}/plain/{before.manifest.shards[0].path}"
    data = bytearray(fs.cat_file(shard))
    start, _ = before._reader(0).span(0)
    assert data[start + 512 : start + 513] == b"0"  # k0's label, its first member
    data[start + 512] = ord("1")  # relabelled: same size
    fs.pipe_file(shard, bytes(data))
    after = open_dataset(url, **s3.storage_options)
    assert after.fingerprint != before.fingerprint
    assert after[0]["cls"] == b"1"


def test_opening_a_bucket_dataset_asks_for_its_manifest_once(s3, bucket):
    """A directory URL with a manifest opens in one request, a GET (no HEAD to ask whether it
    exists first: at 10 ms each way each request was ~25 ms of the first batch), and a prefix
    without one still opens its tars."""
    url = f"s3://{bucket}/ds"
    with ShardWriter(url, format="tar", max_samples=4, **s3.storage_options) as w:
        for i in range(8):
            w.write({"__key__": f"k{i}", "bin": bytes([i]) * 100})
    s3.reset()
    ds = open_dataset(url, **s3.storage_options)
    assert [(r.method, r.path.rsplit("/", 1)[-1]) for r in s3.requests()] == [("GET", "manifest.json")]
    assert len(ds) == 8
    fs = s3.filesystem()
    fs.rm(f"{bucket}/ds/manifest.json")
    bare = open_dataset(url, **s3.storage_options)  # no manifest: the tars beside it, as before
    assert sorted(bare[i]["__key__"] for i in range(len(bare))) == [f"k{i}" for i in range(8)]
