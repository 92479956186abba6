"""The object-storage benches count GETs and bytes in ``benchmarks/s3lab.py``'s proxy, not in the
server: check that it counts exactly what crossed it (one entry per request, the Range asked,
the body bytes sent) and forwards bodies unchanged, uploads (100-continue, chunked) included.
Runs the proxy as the benches do, a subprocess, in front of the moto server on loopback."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stallfree.testing.s3serve import moto_available, serve_s3

REASON = moto_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no moto server: {REASON}")

S3LAB = Path(__file__).resolve().parents[2] / "benchmarks" / "s3lab.py"


def _log(endpoint: str, method: str = "GET") -> list[dict]:
    req = urllib.request.Request(endpoint + "/_count", method=method)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def _proxy(s3: Any, *extra: str) -> Iterator[str]:
    """The counting proxy in front of ``s3``, as the benches start it; yields its plain endpoint."""
    proxy = subprocess.Popen(
        [
            sys.executable,
            str(S3LAB),
            "count",
            "--listen",
            "127.0.0.1:0",
            "--to",
            f"127.0.0.1:{s3.port}",
            *extra,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proxy.stdout.readline()
        assert line.startswith("listening on 127.0.0.1:"), line
        yield "http://" + line.split()[-1]
    finally:
        proxy.kill()
        proxy.wait(10)


def test_counting_proxy_counts_each_request_and_its_bytes():
    with serve_s3() as s3, _proxy(s3) as endpoint:
        fs = s3.filesystem(endpoint_url=endpoint)
        fs.call_s3("create_bucket", Bucket="smoke")
        payload = bytes(range(256)) * 8192  # 2 MiB: botocore sends Expect: 100-continue
        fs.pipe_file("smoke/obj.bin", payload)
        _log(endpoint, "DELETE")
        assert fs.cat_file("smoke/obj.bin", start=1000, end=1100) == payload[1000:1100]
        assert fs.cat_file("smoke/obj.bin") == payload
        gets = [r for r in _log(endpoint) if r["method"] == "GET"]
        assert [(r["path"], r["range"], r["status"], r["bytes"]) for r in gets] == [
            ("/smoke/obj.bin", "bytes=1000-1099", 206, 100),
            ("/smoke/obj.bin", None, 200, len(payload)),
        ]
        # the server saw the same two GETs: nothing dropped, duplicated or invented
        served = [r for r in s3.requests() if r.method == "GET" and r.path == "/smoke/obj.bin"]
        assert [r.bytes for r in served][-2:] == [100, len(payload)]


def test_delayed_port_holds_each_direction_and_counts_the_same():
    """``--delayed A:P:MS``: a fresh connection pays the handshake and the request's round trip
    (4 one-way delays), bodies pass unchanged, and the log is the one the plain port shows."""
    from stallfree.cache.server import free_port

    delay_ms = 150
    port = free_port()
    with serve_s3() as s3, _proxy(s3, "--delayed", f"127.0.0.1:{port}:{delay_ms}") as plain:
        delayed = f"http://127.0.0.1:{port}"
        fs = s3.filesystem(endpoint_url=plain)
        fs.call_s3("create_bucket", Bucket="late")
        payload = bytes(range(256)) * 4096
        fs.pipe_file("late/obj.bin", payload)
        _log(plain, "DELETE")
        far = s3.filesystem(endpoint_url=delayed)
        t0 = time.monotonic()
        body = far.cat_file("late/obj.bin")
        took = time.monotonic() - t0
        assert body == payload
        assert took >= 4 * delay_ms / 1000  # SYN, SYN-ACK, request, response
        [get] = [r for r in _log(plain) if r["method"] == "GET"]
        assert (get["path"], get["status"], get["bytes"]) == ("/late/obj.bin", 200, len(payload))
