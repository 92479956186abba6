"""A real S3 API server on loopback for tests and benchmarks: moto's server (``moto[server]``) in its
own process, wrapped in a small WSGI layer that records every request it receives (method, path,
query, ``Range`` header, response bytes), so a test can count the GETs a read made *at the server*.

Why a wrapper and not moto's own API: moto's server has no request log. The wrapper runs in the
server process, in front of moto's dispatcher; it answers ``/_stallfree/requests`` (GET: the log as
JSON, DELETE: clear it) itself. That path can never be an S3 bucket (``_`` is not allowed in bucket
names), so it cannot shadow a real request.

Binds to 127.0.0.1 only. Clients talk to it through ``s3fs`` exactly as users do: ``s3://bucket/key``
with ``endpoint_url``, key and secret in ``storage_options`` (``S3Server.storage_options``), or the
standard AWS environment variables for a CLI subprocess (``S3Server.env``).

Run as ``python -m stallfree.testing.s3serve --port-file F`` (what ``serve_s3`` does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
LOG_PATH = "/_stallfree/requests"
FAULT_PATH = "/_stallfree/fault"
_REFUSAL = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied (refused on purpose by the test server)</Message></Error>"
)
KEY_ID = "testing"
SECRET = "testing"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Request:
    """One request the server received."""

    method: str
    path: str
    query: str
    range: str | None
    refused: bool = False
    bytes: int = 0  # response body bytes the server sent (counted as they are sent)

    @property
    def is_ranged_get(self) -> bool:
        return self.method == "GET" and self.range is not None


class _Recorder:
    """WSGI middleware: log each request, then hand it to moto."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.log: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        # refuse matching requests number after .. after+count-1 (counted from when the fault is set)
        self.fault: dict[str, Any] = {"after": -1, "count": 0}
        self.seen = 0

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == LOG_PATH:
            with self.lock:
                body = json.dumps(self.log).encode()
                if environ["REQUEST_METHOD"] == "DELETE":
                    self.log.clear()
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]
        if path == FAULT_PATH:
            size = int(environ.get("CONTENT_LENGTH") or 0)
            fault = json.loads(environ["wsgi.input"].read(size))
            with self.lock:
                self.fault, self.seen = fault, 0
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        entry = {
            "method": environ["REQUEST_METHOD"],
            "path": path,
            "query": environ.get("QUERY_STRING", ""),
            "range": environ.get("HTTP_RANGE"),
            "bytes": 0,
        }
        with self.lock:  # recorded before moto answers: a client holding its response sees it counted
            f = self.fault
            refuse = False
            if entry["method"] == f.get("method", entry["method"]) and f.get("query", "") in entry["query"]:
                refuse = f["after"] <= self.seen < f["after"] + f["count"]
                self.seen += 1
            entry["refused"] = refuse
            self.log.append(entry)
        if refuse:  # 403, not 5xx: botocore retries 5xx, so a 503 would not reach the caller
            start_response(
                "403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(_REFUSAL)))]
            )
            entry["bytes"] = len(_REFUSAL)
            return [_REFUSAL]
        return _counted(self.app(environ, start_response), entry)


def _counted(body: Any, entry: dict[str, Any]) -> Iterator[bytes]:
    """The response body, its bytes added to ``entry`` as each piece goes out (before it is
    written: a client holding the bytes sees them counted); the app's iterable is closed after."""
    try:
        for piece in body:
            entry["bytes"] += len(piece)
            yield piece
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()


def _serve(port_file: Path) -> None:
    """The server process: moto's app behind the recorder, on an ephemeral loopback port."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = _Recorder(DomainDispatcherApplication(create_backend_app))
    server = make_server(HOST, 0, app, threaded=True)
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_port))
    tmp.replace(port_file)  # the parent sees the whole number or nothing
    server.serve_forever()


@dataclass
class S3Server:
    """Handle on a running server: where it is, how to reach it, what it has received."""

    port: int
    process: subprocess.Popen
    # the filesystem create_bucket uses, made on first use in each process (an s3fs filesystem is
    # not fork-safe): a new s3fs client (botocore session, endpoint resolution) costs ~0.15 CPU-s,
    # and the tests create a bucket for nearly every test
    _admin: dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What ``open_dataset(url, **storage_options)`` / ``ShardWriter`` pass on to s3fs."""
        return {
            "key": KEY_ID,
            "secret": SECRET,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": REGION},
            "skip_instance_cache": True,
        }

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables a CLI subprocess reads (botocore honours ``AWS_ENDPOINT_URL``)."""
        return {
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def filesystem(self, **overrides: Any):
        """A fresh s3fs filesystem on this server."""
        import s3fs

        return s3fs.S3FileSystem(**{**self.storage_options, **overrides})

    def create_bucket(self, name: str) -> None:
        """A bucket in the server's region (s3fs's ``mkdir`` sends a location constraint moto refuses
        for us-east-1)."""
        fs = self._admin.get(os.getpid())
        if fs is None:
            fs = self._admin[os.getpid()] = self.filesystem()
        fs.call_s3("create_bucket", Bucket=name)
        fs.invalidate_cache()

    def _call(self, method: str, path: str, data: bytes | None = None) -> bytes:
        # text/plain: urllib's default form type would make moto parse the body as a form
        headers = {"Content-Type": "text/plain"}
        req = urllib.request.Request(self.endpoint_url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.read()

    def requests(self) -> list[S3Request]:
        """Every request received since the last ``reset`` (the log's own requests not included)."""
        return [S3Request(**r) for r in json.loads(self._call("GET", LOG_PATH))]

    def reset(self) -> None:
        self._call("DELETE", LOG_PATH)

    def enforce_auth(self, after: int | None = 0) -> None:
        """Have moto check credentials and IAM policies from the ``after``-th request on (counted
        from now; None: never again). Moto does this only partially: S3 actions against IAM user
        policies, enough for "this user may not read". Requests before that go unchecked, which is
        also how a test makes a run fail part-way: every request after the N-th is refused."""
        self._call("POST", "/moto-api/reset-auth", b"inf" if after is None else str(after).encode())

    def refuse(self, after: int, count: int = 1, method: str | None = None, query: str = "") -> None:
        """Answer ``count`` requests, after the next ``after``, with 403 AccessDenied, then serve
        normally again: a store that fails part-way through a run and recovers. Only requests
        with ``method`` (any if None) and ``query`` in their query string are counted."""
        fault: dict[str, Any] = {"after": after, "count": count, "query": query}
        if method is not None:
            fault["method"] = method
        self._call("POST", FAULT_PATH, json.dumps(fault).encode())

    def create_user(self, name: str, *statements: dict[str, Any]) -> tuple[str, str]:
        """An IAM user with an inline policy of ``statements``; returns its (key id, secret)."""
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
            region_name=REGION,
        )
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": list(statements)}
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def moto_available() -> str | None:
    """None if the server can run here, else why not (for a test's skip reason)."""
    for mod in ("moto.moto_server.werkzeug_app", "flask", "s3fs"):
        try:
            __import__(mod)
        except ImportError as exc:
            return f"{mod} is not installed ({exc}); pip install 'moto[server]' s3fs"
    return None


@contextlib.contextmanager
def serve_s3(start_timeout_s: float = 60.0) -> Iterator[S3Server]:
    """Start the server process, wait until it answers, yield it, stop it."""
    with tempfile.TemporaryDirectory(prefix="s3serve-") as tmp:
        port_file = Path(tmp) / "port"
        env = dict(os.environ)
        env.pop("AWS_ENDPOINT_URL", None)
        log_file = Path(tmp) / "server.log"  # a file, not a pipe: a full pipe would stall the server
        with open(log_file, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "stallfree.testing.s3serve", "--port-file", str(port_file)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        server = None
        try:
            deadline = time.monotonic() + start_timeout_s
            while not port_file.exists():
                if proc.poll() is not None:
                    err = log_file.read_text(errors="replace")
                    raise RuntimeError(f"the S3 server exited with {proc.returncode}: {err[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server did not start within {start_timeout_s:.0f} s")
                time.sleep(0.05)
            server = S3Server(int(port_file.read_text()), proc)
            server.requests()  # answers: up
            yield server
        finally:
            if server is not None:
                server.stop()
            elif proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="moto S3 server on loopback with a request log")
    parser.add_argument("--port-file", type=Path, required=True, help="write the bound port here")
    _serve(parser.parse_args(argv).port_file)


if __name__ == "__main__":
    main()
