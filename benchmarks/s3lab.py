"""An S3 bucket one real round trip away, for the object-storage benchmarks: ``s3rver`` (npm) in a
NetLab storage namespace, behind a counting HTTP proxy that also holds every byte for the delay.

    client (node0) --> counter storage:9000+ms (one-way delay ms; no delay on 127.0.0.1:4600)
                   --> s3rver 127.0.0.1:4568 (objects are files: a ranged GET reads the range)

(``rig="two-hop"``: a ``NetLab.relay`` process per delay in front of an undelayed counter, as
the first benches ran: one more Python process copying every byte on the readers' cores.)

Why s3rver and not moto: moto answers a ranged GET by reading the whole object (see
``bench_s3_server.py`` for the measurement), so a ranged reader pays a whole-shard read per GET
there and nowhere else. Why a counting proxy: s3rver keeps no request log; the proxy records each
request (method, path, query, Range, status) and the response body bytes it forwarded, and answers
``GET /_count`` (the log as JSON) and ``DELETE /_count`` (clear it) itself; ``_`` cannot start a
bucket name, so those paths never shadow a request.

Every delay in ``delays_ms`` gets its own port, so one run measures 0, 10 and 25 ms side by side
on one server. Run ``python benchmarks/s3lab.py count --listen A:P --to A:P [--delayed A:P:MS]``
for the proxy alone (what ``S3Lab`` starts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from stallfree.testing.netlab import DelayedWriter

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
S3RVER = REPO / ".venv-s3bench" / "node" / "node_modules" / ".bin" / "s3rver"
S3RVER_KEY = "S3RVER"  # s3rver's fixed access key id and secret
REGION = "us-east-1"
S3RVER_PORT, COUNT_PORT, RELAY_BASE = 4568, 4600, 9000


# -- s3rver ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def s3rver_process(address: str, port: int, popen: Any = subprocess.Popen) -> Iterator[tuple[str, Any]]:
    """``s3rver`` on ``address:port`` (0: any) with a fresh data folder; yields (endpoint, process)."""
    if not S3RVER.exists():
        raise RuntimeError(f"{S3RVER} missing: bash benchmarks/env.sh s3")
    data = Path(tempfile.mkdtemp(prefix="s3rver-"))
    proc = popen(
        [str(S3RVER), "-d", str(data), "-a", address, "-p", str(port), "--silent"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        while not seen or "listening on" not in seen[-1]:
            seen.append(proc.stdout.readline())
            if not seen[-1] or len(seen) > 20:
                raise RuntimeError(f"s3rver did not start: {''.join(seen)!r}")
        line = seen[-1]
        yield f"http://{line.strip().rsplit(' ', 1)[1]}", proc
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)


def wait_http(endpoint: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=5).read()
            return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# -- the counting proxy ----------------------------------------------------------------------------
def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
    return lines[0], fields


async def _copy_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fields: dict[str, str], no_body: bool
) -> int:
    """Forward one message body (Content-Length or chunked); returns its payload bytes."""
    if no_body:
        return 0
    if "chunked" in fields.get("transfer-encoding", "").lower():
        total = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            writer.write(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    line = await reader.readuntil(b"\r\n")
                    writer.write(line)
                    if line == b"\r\n":
                        return total
            writer.write(await reader.readexactly(size + 2))
            total += size
            await writer.drain()
    left = int(fields.get("content-length", "0"))
    total = left
    while left:
        piece = await reader.read(min(left, 1 << 16))
        if not piece:
            raise ConnectionError("body cut short")
        writer.write(piece)
        left -= len(piece)
        await writer.drain()
    return total


class Counter:
    def __init__(self, to: tuple[str, int]) -> None:
        self.to = to
        self.log: list[dict[str, Any]] = []

    async def handle(
        self, cr: asyncio.StreamReader, raw_cw: asyncio.StreamWriter, delay_s: float = 0.0
    ) -> None:
        """One client connection; ``delay_s``: the one-way delay between client and server
        (both directions, and the connection's handshake: SYN, SYN-ACK), as a relay in front
        of this proxy would add it; request times are stamped on the server's side of it."""
        if delay_s:
            await asyncio.sleep(2 * delay_s)  # the SYN's trip and the SYN-ACK's back
        cw = DelayedWriter(raw_cw, delay_s)
        sr = sw = None
        try:
            while True:
                try:
                    head = await cr.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                # wall clock: the namespaces share one, so clients can line up
                started = time.time() + delay_s
                first, fields = _headers(head)
                method, target = first.split(" ")[:2]
                if target.startswith("/_count"):
                    body = json.dumps(self.log).encode()
                    if method == "DELETE":
                        self.log = []
                    cw.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                    await cw.drain()
                    continue
                if sr is None:
                    sr, raw_sw = await asyncio.open_connection(*self.to)
                    sw = DelayedWriter(raw_sw, delay_s)
                if fields.get("expect", "").lower() == "100-continue":  # answer it here, strip it there
                    cw.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = b"\r\n".join(
                        ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"expect:")
                    )
                sw.write(head)
                await _copy_body(cr, sw, fields, False)
                await sw.drain()
                while True:
                    rhead = await sr.readuntil(b"\r\n\r\n")
                    status_line, rfields = _headers(rhead)
                    status = int(status_line.split(" ")[1])
                    cw.write(rhead)
                    if status != 100:
                        break
                no_body = method == "HEAD" or status in (204, 304)
                sent = await _copy_body(sr, cw, rfields, no_body)
                await cw.drain()
                path, _, query = target.partition("?")
                self.log.append(
                    {"method": method, "path": path, "query": query, "range": fields.get("range"),
                     "status": status, "bytes": sent, "start": started, "end": time.time()}
                )  # fmt: skip
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            for w in (cw, sw):
                if w is not None:
                    with contextlib.suppress(OSError):
                        await w.finish()  # what is queued is delivered first
                    w.writer.close()


async def _serve_counter(
    listen: tuple[str, int], to: tuple[str, int], delayed: Sequence[tuple[str, int, float]] = ()
) -> None:
    """The counter on ``listen`` (no delay) and on each ``delayed`` (address, port, one-way
    delay in seconds), one request log for all of them."""
    counter = Counter(to)
    server = await asyncio.start_server(
        counter.handle, listen[0], listen[1], reuse_address=True, limit=1 << 20
    )
    others = [
        await asyncio.start_server(
            lambda r, w, d=d: counter.handle(r, w, d), host, port, reuse_address=True, limit=1 << 20
        )
        for host, port, d in delayed
    ]
    host, port = server.sockets[0].getsockname()[:2]  # port 0: the one the kernel chose
    sys.stdout.write(f"listening on {host}:{port}\n")  # once every listener is up
    sys.stdout.flush()
    async with contextlib.AsyncExitStack() as stack:
        for srv in (server, *others):
            await stack.enter_async_context(srv)
        await server.serve_forever()


# -- the lab -------------------------------------------------------------------------------------
RIGS = ("one-hop", "two-hop")


class S3Lab:
    """NetLab(nodes=1) with s3rver and the counter in storage (a context manager).
    ``endpoint(ms)`` is the URL a client in node0 uses for that one-way delay.

    ``rig``: "one-hop" (the counter itself holds each direction for the delay: one proxy
    process between client and s3rver) or "two-hop" (a ``NetLab.relay`` per delay in front of
    the counter, as the first benches ran). Same delays, same counts; one-hop costs the cores
    the readers share about one Python hop less (``bench_s3_netns.py``'s rig CPU column)."""

    def __init__(self, delays_ms: Sequence[int] = (0, 10, 25), rig: str = "one-hop") -> None:
        from stallfree.testing.netlab import NetLab

        if rig not in RIGS:
            raise ValueError(f"rig must be one of {RIGS}, got {rig!r}")
        self.rig = rig
        self.delays_ms = tuple(delays_ms)
        self.lab = NetLab(nodes=1)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> S3Lab:
        lab = self._stack.enter_context(self.lab)
        self._stack.enter_context(
            s3rver_process(
                "127.0.0.1", S3RVER_PORT, popen=lambda argv, **kw: lab.popen("storage", argv, **kw)
            )
        )
        delayed = []
        if self.rig == "one-hop":
            for ms in self.delays_ms:
                delayed += ["--delayed", f"{lab.storage.address}:{RELAY_BASE + ms}:{ms}"]
        counter = lab.popen(
            "storage",
            [sys.executable, str(Path(__file__).resolve()), "count",
             "--listen", f"127.0.0.1:{COUNT_PORT}", "--to", f"127.0.0.1:{S3RVER_PORT}", *delayed],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        if not counter.stdout.readline().startswith("listening"):
            raise RuntimeError("the counting proxy did not start")
        if self.rig == "two-hop":
            for ms in self.delays_ms:
                lab.relay("storage", RELAY_BASE + ms, to=("127.0.0.1", COUNT_PORT), one_way_delay_s=ms / 1000)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def endpoint(self, ms: int) -> str:
        return f"http://{self.lab.storage.address}:{RELAY_BASE + ms}"

    def run_in_node(self, argv: Sequence[str], timeout: float) -> int:
        return self.lab.run("node0", list(argv), timeout=timeout, cwd=REPO).returncode


# -- client-side helpers (used inside node0) ------------------------------------------------------
def aws_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": S3RVER_KEY,
        "AWS_SECRET_ACCESS_KEY": S3RVER_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "S3_ENDPOINT_URL": endpoint,  # MosaicML Streaming's own variable
        "AWS_ALLOW_HTTP": "true",  # object_store (obstore, used by LitData) refuses http:// without it
    }


def storage_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": S3RVER_KEY,
        "secret": S3RVER_KEY,
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": REGION},
        "skip_instance_cache": True,
    }


def requests_log(endpoint: str, clear: bool = False) -> list[dict[str, Any]]:
    req = urllib.request.Request(endpoint + "/_count", method="DELETE" if clear else "GET")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _delayed(text: str) -> tuple[str, int, float]:
    where, _, ms = text.rpartition(":")
    host, port = _address(where)
    return host, port, float(ms) / 1000


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="s3lab.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("count", help="a counting HTTP/1.1 proxy")
    c.add_argument("--listen", required=True, type=_address)
    c.add_argument("--to", required=True, type=_address)
    c.add_argument("--delayed", action="append", default=[], type=_delayed, metavar="ADDRESS:PORT:MS",
                   help="also listen there, every byte held MS ms in each direction")  # fmt: skip
    args = ap.parse_args(argv)
    asyncio.run(_serve_counter(args.listen, args.to, args.delayed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
