"""stallfree against a real S3 API (moto's server on loopback) through s3fs, as users run it:
``s3://bucket/prefix`` with credentials and endpoint in ``storage_options`` (library) or the standard
AWS variables (CLI, in a subprocess). Requests are counted at the server (its request log)."""

import io
import json
import os
import random
import subprocess
import sys
import tarfile

import pytest

from stallfree.errors import MissingShardError, ShardReadError
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter

CLI_TIMEOUT = 300


def _cli(s3, *args, env_extra=None):
    env = {**os.environ, **s3.env, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "stallfree", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )


def _source_folder(root, n=10, size=3000):
    """A folder of files grouped by base name (k.bin + k.cls -> one sample); returns the samples."""
    root.mkdir()
    rng = random.Random(0)
    expected = {}
    for i in range(n):
        key = f"k{i:03d}"
        data = rng.randbytes(size + i)
        (root / f"{key}.bin").write_bytes(data)
        (root / f"{key}.cls").write_bytes(str(i % 3).encode())
        expected[key] = {"bin": data, "cls": str(i % 3).encode()}
    return expected


def _write(s3, url, n=12, fmt="tar", per_shard=5):
    samples = [{"__key__": f"s{i:03d}", "bin": os.urandom(2000 + i), "cls": i % 4} for i in range(n)]
    with ShardWriter(url, format=fmt, max_samples=per_shard, **s3.storage_options) as w:
        for smp in samples:
            w.write(smp)
    return samples


@pytest.mark.slow
def test_cli_shard_to_s3_then_open_and_verify(s3, bucket, tmp_path):
    expected = _source_folder(tmp_path / "src")
    url = f"s3://{bucket}/out"
    r = _cli(s3, "shard", str(tmp_path / "src"), url, "--max-samples", "4", "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["samples"] == 10 and summary["shards"] == 3
    names = sorted(p.rsplit("/", 1)[-1] for p in s3.filesystem().ls(f"{bucket}/out"))
    sidecars = ("idx", "sums", "tar")
    assert names == ["manifest.json"] + [f"shard-00000{i}.{e}" for i in range(3) for e in sidecars]

    ds = open_dataset(url, **s3.storage_options)
    got = {ds[i]["__key__"]: {k: v for k, v in ds[i].items() if k != "__key__"} for i in range(len(ds))}
    assert got == expected

    r = _cli(s3, "verify", url, "--no-progress", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["samples"] == 10 and report["shards"] == 3


def test_cli_verify_finds_a_changed_object(s3, bucket):
    url = f"s3://{bucket}/ds"
    _write(s3, url)
    fs = s3.filesystem()
    data = bytearray(fs.cat_file(f"{bucket}/ds/shard-000001.tar"))
    data[1024 + 100] ^= 0xFF  # inside the first member's data: size unchanged, hash not
    fs.pipe(f"{bucket}/ds/shard-000001.tar", bytes(data))
    r = _cli(s3, "verify", url, "--no-progress")
    assert r.returncode == 1
    assert "shard-000001.tar" in r.stdout and "sha256" in r.stdout


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_one_ranged_get_per_sample(s3, bucket, fmt):
    url = f"s3://{bucket}/ds"
    samples = _write(s3, url, n=15, fmt=fmt)
    ds = open_dataset(url, **s3.storage_options)
    for i in (0, 5, 10):  # open each shard once (size, index, header checks)
        ds[i]
    s3.reset()
    order = [7, 3, 14, 0, 9, 12, 1]
    for i in order:
        got = ds[i]
        assert got["bin"] == samples[i]["bin"] and got["__key__"] == samples[i]["__key__"]
    reqs = s3.requests()
    shard_of = [f"/{bucket}/ds/shard-{i // 5:06d}.{fmt}" for i in order]
    assert [r.path for r in reqs] == shard_of
    assert all(r.is_ranged_get for r in reqs), reqs


def test_plain_webdataset_prefix_without_manifest(s3, bucket):
    """A prefix of plain WebDataset tars (no manifest, no .idx): listed, indexed from the headers,
    then one ranged GET per sample."""
    fs = s3.filesystem()
    expected = []
    for t in range(2):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(4):
                key = f"part{t}/s{i}"
                sample = {"__key__": key, "cls": str(i).encode(), "jpg": os.urandom(700 + i)}
                for ext in ("cls", "jpg"):
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(sample[ext])
                    tf.addfile(ti, io.BytesIO(sample[ext]))
                expected.append(sample)
        fs.pipe(f"{bucket}/wds/part-{t}.tar", buf.getvalue())
    ds = open_dataset(f"s3://{bucket}/wds", **s3.storage_options)
    assert ds.manifest.format == "tar" and len(ds) == 8
    assert [ds[i] for i in range(8)] == expected
    s3.reset()
    assert ds[6] == expected[6]
    assert [(r.path, r.is_ranged_get) for r in s3.requests()] == [(f"/{bucket}/wds/part-1.tar", True)]


def test_missing_bucket_is_named(s3):
    with pytest.raises(MissingShardError, match="bucket 'no-such-bucket' does not exist"):
        open_dataset("s3://no-such-bucket/ds", **s3.storage_options)
    r = _cli(s3, "verify", "s3://no-such-bucket/ds", "--no-progress")
    # verify reports it as its one problem (verify.py does not name the bucket yet)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "no manifest at no-such-bucket/ds/manifest.json" in r.stdout


def test_cli_shard_to_missing_bucket_fails_cleanly(s3, tmp_path):
    _source_folder(tmp_path / "src", n=3)
    r = _cli(s3, "shard", str(tmp_path / "src"), "s3://absent-bucket-shard/out", "--no-progress")
    exists = s3.filesystem().exists("absent-bucket-shard")
    assert not exists, "the run created the bucket"
    assert r.returncode == 1, r.stderr
    assert "bucket does not exist" in r.stderr and "Traceback" not in r.stderr


def test_missing_prefix_and_missing_object(s3, bucket):
    with pytest.raises(MissingShardError, match=f"no dataset at s3://{bucket}/nothing"):
        open_dataset(f"s3://{bucket}/nothing", **s3.storage_options)
    url = f"s3://{bucket}/ds"
    samples = _write(s3, url)
    s3.filesystem().rm(f"{bucket}/ds/shard-000001.tar")
    ds = open_dataset(url, **s3.storage_options)
    assert ds[0]["bin"] == samples[0]["bin"]  # other shards still read
    with pytest.raises(MissingShardError, match=r"shard not found \(shard shard-000001.tar\)"):
        ds[6]


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param({"after": 0, "method": "PUT"}, id="first-upload"),
        pytest.param({"after": 3, "method": "PUT"}, id="fourth-put"),
    ],
)
def test_failed_cli_shard_run_leaves_no_final_object(s3, bucket, tmp_path, fault):
    """One request part-way through the run is refused (403 from the server, then it serves again):
    the run fails, and no object exists under a final name, no manifest. Hidden temp objects of
    the failed writer may remain (the next run removes stale ones)."""
    _source_folder(tmp_path / "src", n=12)
    try:
        s3.refuse(**fault)
        r = _cli(
            s3, "shard", str(tmp_path / "src"), f"s3://{bucket}/out", "--max-samples", "3", "--no-progress"
        )
    finally:
        s3.refuse(after=-1, count=0)
    refused = [q for q in s3.requests() if q.refused]
    assert len(refused) == 1
    assert r.returncode == 1, (refused, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "error" in r.stderr
    written = [p.rsplit("/", 1)[-1] for p in s3.filesystem().find(f"{bucket}/out")]
    assert [n for n in written if not n.startswith(".")] == [], (refused, written)


# The commit copies the temp object to its final name, then deletes the temp (a DELETE request):
# 4 shards of 3 samples, each its .idx, .sums then .tar, then the manifest -> DELETEs 0..12.
@pytest.mark.parametrize(
    ("nth_delete", "stale"),
    [
        pytest.param(0, "shard-000000.idx", id="idx-temp-delete"),
        pytest.param(1, "shard-000000.sums", id="sums-temp-delete"),
        pytest.param(2, "shard-000000.tar", id="tar-temp-delete"),
        pytest.param(5, "shard-000001.tar", id="tar2-temp-delete"),
        pytest.param(12, "manifest.json", id="manifest-temp-delete"),
    ],
)
def test_refused_temp_delete_still_commits(s3, bucket, tmp_path, nth_delete, stale):
    """Only the delete of a temp object (after its copy to the final name) is refused: the run
    succeeds with every final object and the manifest right, the leftover temp is named in a
    warning, and the next run into the prefix removes it."""
    expected = _source_folder(tmp_path / "src", n=12)
    url = f"s3://{bucket}/out"
    args = ("shard", str(tmp_path / "src"), url, "--max-samples", "3", "--no-progress", "--json")
    try:
        s3.refuse(after=nth_delete, method="DELETE")
        r = _cli(s3, *args)
    finally:
        s3.refuse(after=-1, count=0)
    refused = [q for q in s3.requests() if q.refused]
    assert [q.method for q in refused] == ["DELETE"]
    assert r.returncode == 0, (refused, r.stdout, r.stderr)
    assert json.loads(r.stdout)["shards"] == 4

    fs = s3.filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{bucket}/out"))
    temps = [n for n in names if n.startswith(".")]
    assert len(temps) == 1 and temps[0].startswith(f".{stale}.tmp-"), names
    assert refused[0].path == f"/{bucket}/out/{temps[0]}"
    finals = [f"shard-00000{i}.{e}" for i in range(4) for e in ("idx", "sums", "tar")]
    assert [n for n in names if not n.startswith(".")] == ["manifest.json", *finals]
    assert "could not be removed" in r.stderr and f"{bucket}/out/{temps[0]}" in r.stderr
    assert "Traceback" not in r.stderr

    manifest = json.loads(fs.cat_file(f"{bucket}/out/manifest.json"))
    assert [(s["path"], s["samples"]) for s in manifest["shards"]] == [
        (f"shard-00000{i}.tar", 3) for i in range(4)
    ]
    ds = open_dataset(url, **s3.storage_options)
    got = {ds[i]["__key__"]: {k: v for k, v in ds[i].items() if k != "__key__"} for i in range(len(ds))}
    assert got == expected
    r = _cli(s3, "verify", url, "--no-progress", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout

    # a later run into the prefix (the writer's process is gone): the stale temp is removed
    r = _cli(s3, *args, "--overwrite")
    assert r.returncode == 0, r.stderr
    fs.invalidate_cache()
    assert [p for p in fs.find(f"{bucket}/out") if p.rsplit("/", 1)[-1].startswith(".")] == []


def test_denied_access_is_a_read_error(s3, bucket):
    """A user whose policy denies s3:* (moto evaluates IAM user policies for S3 actions)."""
    url = f"s3://{bucket}/ds"
    _write(s3, url)
    key_id, secret = s3.create_user("denied", {"Effect": "Deny", "Action": "s3:*", "Resource": "*"})
    options = {**s3.storage_options, "key": key_id, "secret": secret}
    try:
        s3.enforce_auth(after=0)
        with pytest.raises(ShardReadError, match=f"access denied reading s3://{bucket}/ds"):
            open_dataset(url, **options)
        r = _cli(
            s3,
            "verify",
            url,
            "--no-progress",
            env_extra={"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret},
        )
    finally:
        s3.enforce_auth(after=None)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "denied" in (r.stderr + r.stdout).lower() or "forbidden" in (r.stderr + r.stdout).lower()


def test_denied_sample_read_after_open(s3, bucket):
    """Opened while allowed, then every request refused: a sample read says access denied
    (ShardReadError, with shard and offset), not a corrupt shard."""
    url = f"s3://{bucket}/ds"
    _write(s3, url)
    key_id, secret = s3.create_user("denied-later", {"Effect": "Deny", "Action": "s3:*", "Resource": "*"})
    ds = open_dataset(url, **{**s3.storage_options, "key": key_id, "secret": secret})
    ds[0]  # opens shard 0 (not yet checked)
    try:
        s3.enforce_auth(after=0)
        with pytest.raises(
            ShardReadError, match=r"access denied.*\(shard shard-000000.tar, sample 's001', byte offset \d+\)"
        ):
            ds[1]
    finally:
        s3.enforce_auth(after=None)


def test_request_log_counts_response_bytes(s3, bucket):
    """The server's log has each response's body bytes (what a benchmark bills per sample)."""
    fs = s3.filesystem()
    fs.pipe(f"{bucket}/obj", bytes(range(256)) * 40)
    s3.reset()
    assert fs.cat_file(f"{bucket}/obj", start=100, end=1100) == (bytes(range(256)) * 40)[100:1100]
    assert len(fs.cat_file(f"{bucket}/obj")) == 10240
    got = [(r.method, r.range, r.bytes) for r in s3.requests()]
    # s3fs asks the size (HEAD: no body) before a whole-object read
    assert got == [("GET", "bytes=100-1099", 1000), ("HEAD", None, 0), ("GET", None, 10240)]
