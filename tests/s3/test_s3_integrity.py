"""Remote-read integrity on a real S3 API (moto's server): an object re-uploaded shorter while a
dataset is open never yields a short sample, and a dead or wrong endpoint is our error naming the
endpoint (not a raw botocore exception). The dead-endpoint run stops its own server, so it runs in
a child process with a timeout (``dead_endpoint_child.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.storage.remote import ObjectChangedError

REPO = Path(__file__).resolve().parents[2]


def _write(s3, url, fmt, n=10):
    samples = [{"__key__": f"s{i:03d}", "bin": os.urandom(3000 + 7 * i)} for i in range(n)]
    with ShardWriter(url, format=fmt, max_samples=5, **s3.storage_options) as w:
        for smp in samples:
            w.write(smp)
    return samples


def test_tar_object_reuploaded_shorter_during_a_run(s3, bucket):
    """Reads are pinned to the ETag found at open: every read of the re-uploaded shard, before
    the cut or across it, is ObjectChangedError naming the shard (not a short or a new sample)."""
    url = f"s3://{bucket}/ds"
    samples = _write(s3, url, "tar")
    ds = open_dataset(url, **s3.storage_options)
    assert ds[0]["bin"] == samples[0]["bin"]  # shard 0 open: size, index, headers checked
    fs = s3.filesystem()
    key = f"{bucket}/ds/shard-000000.tar"
    idx = fs.cat_file(f"{bucket}/ds/shard-000000.idx").decode().splitlines()
    off, size = (int(t) for t in idx[5].split()[1:3])  # the last sample's only member
    end = off + size
    fs.pipe(key, fs.cat_file(key)[: end - 7])  # re-uploaded, cut 7 bytes into its last sample
    for i in range(5):
        with pytest.raises(ObjectChangedError) as info:
            ds[i]
        e = info.value
        assert (e.shard, e.key) == ("shard-000000.tar", f"s{i:03d}")
        assert e.url == f"s3://{key} (endpoint {s3.endpoint_url})"
        assert e.pinned.startswith('ETag "') and f"{e.url} changed since its shard was opened" in str(e)
    (span,) = [(e.start, e.end)]
    assert span == (off - 512, end)  # the last sample's bytes, as asked
    with pytest.raises(ObjectChangedError):
        ds.get_many([3, 4, 0])  # the coalesced read covering the cut
    assert ds[6]["bin"] == samples[6]["bin"]  # the other shard is untouched


def test_arrow_object_reuploaded_shorter_during_a_run(s3, bucket):
    """Arrow reads are pinned like tar's: every read of the re-uploaded shard, before the cut or
    across it, is ObjectChangedError naming the shard, never a short read or another row."""
    url = f"s3://{bucket}/ds"
    samples = _write(s3, url, "arrow")
    ds = open_dataset(url, **s3.storage_options)
    assert ds[0]["bin"] == samples[0]["bin"]
    fs = s3.filesystem()
    key = f"{bucket}/ds/shard-000000.arrow"
    data = fs.cat_file(key)
    last = data.rfind(samples[4]["bin"][-64:]) + 64  # the last row's data ends here
    fs.pipe(key, data[: last - 7])
    for i in range(5):
        with pytest.raises(ObjectChangedError) as info:
            ds[i]
        e = info.value
        assert e.shard == "shard-000000.arrow" and e.pinned.startswith('ETag "')
        assert f"s3://{key} (endpoint {s3.endpoint_url}) changed since its shard was opened" in str(e)
    assert ds[6]["bin"] == samples[6]["bin"]  # the other shard is untouched


def test_dead_and_wrong_endpoints_are_named(s3):  # s3: skipped with the reason when moto is absent
    r = subprocess.run(
        [sys.executable, "-m", "tests.s3.dead_endpoint_child"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = {x["what"]: x for x in map(json.loads, r.stdout.splitlines())}
    assert out["before"]["result"] == "ok"
    endpoint, wrong = out["endpoint"]["url"], out["wrong-endpoint"]["url"]
    for what, shard, where in (
        ("opened-shard", "shard-000000.tar", endpoint),
        ("new-shard", "shard-000001.tar", endpoint),
        ("open-wrong", "manifest.json", wrong),
    ):
        x = out[what]
        assert (x["result"], x["type"], x["module"]) == (
            "error",
            "RemoteReadError",
            "stallfree.errors",
        ), x
        assert x["url"] == f"s3://dead/ds/{shard} (endpoint {where})", x
        assert f"(endpoint {where}) failed" in x["message"] and "onnect" in x["message"], x
    glob = out["glob-wrong"]  # a listing, not a read: botocore's error, reworded with the endpoint
    assert (glob["type"], glob["module"]) == ("RemoteReadError", "stallfree.errors"), glob
    assert glob["message"].startswith(f"cannot reach endpoint {wrong} (opening s3://dead/ds/*.tar): "), glob
