"""``stallfree inspect`` and ``stallfree verify`` take ``-o/--storage-option KEY=VALUE`` as
``stallfree shard`` does: here the endpoint and the credentials of a real S3 server (moto's, on
loopback) reach s3fs only through ``-o`` (no AWS variables in the subprocess's environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stallfree.cli import main
from stallfree.shards.writer import ShardWriter
from stallfree.testing.s3serve import KEY_ID, REGION, SECRET, moto_available, serve_s3

CLI_TIMEOUT = 300


@pytest.fixture(scope="module")
def s3_dataset():
    reason = moto_available()
    if reason is not None:
        pytest.skip(reason)
    with serve_s3() as s3:
        s3.create_bucket("opts")
        with ShardWriter("s3://opts/ds", max_samples=4, **s3.storage_options) as w:
            for i in range(10):
                w.write({"__key__": f"k{i:02d}", "bin": bytes([i]) * (100 + i), "cls": i % 3})
        yield s3, "s3://opts/ds"


def _cli_without_aws_env(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_CONFIG_FILE"] = env["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull  # no ~/.aws either
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    return subprocess.run(
        [sys.executable, "-m", "stallfree", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )


def _options(s3) -> list[str]:
    return [
        "-o",
        f"endpoint_url={s3.endpoint_url}",
        "--storage-option",
        f"key={KEY_ID}",
        "-o",
        f"secret={SECRET}",
        "-o",
        f"client_kwargs={json.dumps({'region_name': REGION})}",  # a JSON value: a dict
    ]


def test_inspect_reaches_s3_through_storage_options(s3_dataset):
    s3, url = s3_dataset
    r = _cli_without_aws_env("inspect", url, "--json", *_options(s3))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["format"], info["samples"], info["shards"]) == ("tar", 10, 3)
    assert info["first_sample"] == {"key": "k00", "field_sizes": {"bin": 100, "cls": 1}}


def test_verify_reaches_s3_through_storage_options(s3_dataset):
    s3, url = s3_dataset
    s3.reset()
    r = _cli_without_aws_env("verify", url, "--no-progress", "--json", *_options(s3))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and (report["samples"], report["shards"]) == (10, 3)
    assert any(q.path == "/opts/ds/shard-000002.tar" for q in s3.requests())  # read at this server


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_malformed_storage_option_is_refused_by_name(command, tmp_path, capsys):
    assert main([command, str(tmp_path), "-o", "endpoint_url"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"stallfree {command}: error: storage option must be KEY=VALUE, got 'endpoint_url'"
    )
