"""One resolved location per open on S3 (``storage.fs.Location``): ``open_dataset`` makes one
filesystem for the URL, whether a manifest is found, a brace pattern is expanded or the bucket
turns out not to exist (the bucket check reuses it)."""

from __future__ import annotations

import pytest

from stallfree.errors import MissingShardError
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from tests.shards.test_location import made  # noqa: F401 - the counting fixture


def _write(s3, url: str) -> list[dict]:
    samples = [{"__key__": f"s{i:03d}", "bin": bytes([i]) * (100 + i)} for i in range(9)]
    with ShardWriter(url, format="tar", max_samples=3, **s3.storage_options) as w:
        for s in samples:
            w.write(s)
    return samples


def test_s3_dataset_resolves_its_url_once(s3, bucket, made):  # noqa: F811
    url = f"s3://{bucket}/ds"
    samples = _write(s3, url)
    made.update({k: [] for k in made})
    ds = open_dataset(url, **s3.storage_options)
    assert ds[4]["bin"] == samples[4]["bin"]
    pattern = f"{url}/shard-{{000000..000002}}.tar"
    assert [s["__key__"] for s in open_dataset(pattern, **s3.storage_options)] == [
        s["__key__"] for s in samples
    ]
    with pytest.raises(MissingShardError, match="bucket 'no-such-bucket-here' does not exist"):
        open_dataset("s3://no-such-bucket-here/ds", **s3.storage_options)
    assert made["fsspec"] == [url, pattern, "s3://no-such-bucket-here/ds"]
    assert made["filesystem"] == []
