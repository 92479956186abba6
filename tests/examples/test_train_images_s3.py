"""examples/train_images.py reads its data from an object store given only through ``-o``
storage options (issue 19.7): a real S3 server (moto's, on loopback), no AWS variables or files
in the script's environment, one process, one epoch; every sample is trained on once."""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.shards.writer import ShardWriter
from stallfree.testing.images import jpeg_bytes
from stallfree.testing.s3serve import KEY_ID, REGION, SECRET, moto_available, serve_s3

ROOT = Path(__file__).resolve().parents[2]
N, BATCH = 12, 4


@pytest.mark.slow
def test_train_images_reads_s3_through_storage_options(tmp_path):
    reason = moto_available()
    if reason is not None:
        pytest.skip(reason)
    images = jpeg_bytes(N, sizes=((40, 32),))
    with serve_s3() as s3:
        s3.create_bucket("train")
        with ShardWriter("s3://train/ds", max_samples=5, classes=["a", "b"], **s3.storage_options) as w:
            for i in range(N):
                w.write({"__key__": f"img{i:02d}", "jpg": images[i], "cls": i % 2})
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            AWS_EC2_METADATA_DISABLED="true",
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
        )
        keys = tmp_path / "keys"
        cmd = [
            sys.executable,
            str(ROOT / "examples" / "train_images.py"),
            "--data",
            "s3://train/ds",
            "--ckpt",
            str(tmp_path / "ckpt.pt"),
            "--batch-size",
            str(BATCH),
            "--size",
            "16",
            "--workers",
            "0",
            "--log-keys",
            str(keys),
            "-o",
            f"endpoint_url={s3.endpoint_url}",
            "-o",
            f"key={KEY_ID}",
            "--storage-option",
            f"secret={SECRET}",
            "-o",
            f"client_kwargs={json.dumps({'region_name': REGION})}",
        ]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert any(q.path.startswith("/train/ds/shard-") for q in s3.requests())
    steps = [json.loads(line) for line in Path(f"{keys}.0").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, N // BATCH + 1))
    assert collections.Counter(k for s in steps for k in s["keys"]) == {f"img{i:02d}": 1 for i in range(N)}


def test_storage_option_values_are_json_when_they_parse_and_a_malformed_one_is_refused():
    spec = importlib.util.spec_from_file_location("train_images", ROOT / "examples" / "train_images.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only; main() runs under __main__
    assert module.storage_option("anon=true") == ("anon", True)
    assert module.storage_option("endpoint_url=http://h:9000") == ("endpoint_url", "http://h:9000")
    with pytest.raises(argparse.ArgumentTypeError, match="storage option must be KEY=VALUE, got 'anon'"):
        module.storage_option("anon")
