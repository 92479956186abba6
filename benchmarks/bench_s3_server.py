"""Which S3 server may stand in for a bucket: does a ranged GET cost the server what it returns, or
what the whole object holds?

Real S3 answers ``Range: bytes=a-b`` in time that grows with ``b - a``, not with the object. A
benchmark of ranged readers (ours) against whole-shard readers (WebDataset, Streaming) is only fair
on a server that does the same. This times ``--gets`` 1 KB ranged GETs (random offsets, one boto3
client, keep-alive) of a 1 MB object and of a ``--big-mb`` MB object, on each candidate, on loopback:
  moto     ``stallfree.testing.s3serve`` (moto's server mode, Python)
  s3rver   ``s3rver`` 3.7.1 from npm (Node; objects are files, a ranged GET is a ranged file read)
A server whose per-GET time grows with the object by more than noise reads the whole object per GET.

    .venv-s3bench/bin/python benchmarks/bench_s3_server.py --big-mb 256 --gets 40
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

from s3lab import S3RVER_KEY, s3rver_process, wait_http

from stallfree.testing.s3serve import KEY_ID, REGION, SECRET, serve_s3


def _client(endpoint: str, key: str, secret: str) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name=REGION,
        config=Config(s3={"addressing_style": "path"}),
    )


def time_ranged_gets(client: Any, bucket: str, key: str, size: int, gets: int, span: int = 1000) -> float:
    """Median seconds of one ``span``-byte ranged GET at a random offset of ``key``."""
    rng = random.Random(0)
    times = []
    for _ in range(gets):
        off = rng.randrange(0, size - span)
        t0 = time.perf_counter()
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + span - 1}")["Body"].read()
        times.append(time.perf_counter() - t0)
        if len(body) != span:
            raise RuntimeError(f"{key}: asked {span} bytes at {off}, got {len(body)}")
    return statistics.median(times)


def measure(client: Any, big_mb: int, gets: int) -> dict[str, float]:
    client.create_bucket(Bucket="probe")
    small, big = os.urandom(1 << 20), os.urandom(1 << 20) * big_mb
    client.put_object(Bucket="probe", Key="small", Body=small)
    client.put_object(Bucket="probe", Key="big", Body=big)
    time_ranged_gets(client, "probe", "small", len(small), 3)  # warm the connection
    out = {
        "small_ms": 1000 * time_ranged_gets(client, "probe", "small", len(small), gets),
        "big_ms": 1000 * time_ranged_gets(client, "probe", "big", len(big), gets),
    }
    out["ratio"] = out["big_ms"] / out["small_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mb", type=int, default=256)
    ap.add_argument("--gets", type=int, default=40)
    args = ap.parse_args(argv)
    results = {}
    with serve_s3() as moto:
        results["moto"] = measure(_client(moto.endpoint_url, KEY_ID, SECRET), args.big_mb, args.gets)
    with s3rver_process("127.0.0.1", 0) as (endpoint, _):
        wait_http(endpoint)
        results["s3rver"] = measure(_client(endpoint, S3RVER_KEY, S3RVER_KEY), args.big_mb, args.gets)
    print(f"median of {args.gets} 1 KB ranged GETs, loopback, load average {os.getloadavg()[0]:.1f}")
    print(f"{'server':<8} {'1 MB object':>12} {f'{args.big_mb} MB object':>14} {'ratio':>7}")
    for name, r in results.items():
        print(f"{name:<8} {r['small_ms']:>9.2f} ms {r['big_ms']:>11.2f} ms {r['ratio']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
