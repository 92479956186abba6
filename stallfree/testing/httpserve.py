"""A real HTTP server on loopback that serves a directory with byte ranges, optional per-request
latency, bandwidth caps (per response, and one link shared by all responses), and counts what it
sends. ``server.faults`` makes it misbehave on purpose while it runs (bodies cut short with a
matching ``Content-Length``, ``Range`` ignored, an error status, no answer at all), and
``server.kill()`` makes it die mid-run: what remote-read integrity tests need.

Used by tests (remote storage through fsspec's ``http://``) and benchmarks (slow storage on
purpose, so stall from remote reads is measured, not imagined). Binds to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
_CHUNK = 64 * 1024


@dataclass
class ServerStats:
    """Counters of one server; read them between phases of a test, or reset()."""

    requests: int = 0
    range_requests: int = 0
    bytes_sent: int = 0
    paths: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, path: str, nbytes: int, ranged: bool) -> None:
        """Count a request. Called before the response's last byte goes out, so a client that
        has its response always sees it counted (tests read the counters right after a read)."""
        with self._lock:
            self.requests += 1
            self.range_requests += int(ranged)
            self.bytes_sent += nbytes
            self.paths[path] = self.paths.get(path, 0) + 1

    def add_bytes(self, nbytes: int) -> None:
        """Body bytes about to be written (counted first, for the same reason as ``record``)."""
        with self._lock:
            self.bytes_sent += nbytes

    def reset(self) -> None:
        with self._lock:
            self.requests = self.range_requests = self.bytes_sent = 0
            self.paths.clear()


class SharedLink:
    """A token bucket over all responses: a storage link of ``bytes_per_s`` that concurrency cannot
    widen (what the harness's what-if model calls S)."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"link bandwidth must be positive, got {bytes_per_s}")
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = time.perf_counter()

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes`` on the link; returns the time at which they have passed."""
        with self._lock:
            start = max(self._free_at, time.perf_counter())
            self._free_at = start + nbytes / self.rate
            return self._free_at


@dataclass
class Faults:
    """How the server misbehaves, switched on and off while it runs (a test flips them
    mid-epoch). Each applies to requests whose path ends in ``suffix`` ("": all), for the next
    ``count`` such requests (None: until switched off). ``hit`` counts the requests it spoiled.

    ``short_by``: bodies this many bytes short, sent with a ``Content-Length`` (and
    ``Content-Range``) that match the short body: a consistent liar no HTTP client can catch.
    ``ignore_range``: answer 200 with the whole file, whatever ``Range`` asks.
    ``status``: answer with this status (500, 503, ...) and an empty body.
    ``hang``: read the request and never answer (until the fault is cleared or the server stops)."""

    short_by: int = 0
    ignore_range: bool = False
    status: int | None = None
    hang: bool = False
    suffix: str = ""
    count: int | None = None
    hit: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set(self, **changes) -> None:
        """Replace the whole fault setting at once (fields not named go back to their defaults),
        so a request never sees half of an old setting and half of a new one."""
        with self._lock:
            for name in ("short_by", "ignore_range", "status", "hang", "suffix", "count"):
                setattr(self, name, changes.pop(name, Faults.__dataclass_fields__[name].default))
            if changes:
                raise TypeError(f"unknown fault(s): {sorted(changes)}")
            self.hit = 0

    def clear(self) -> None:
        self.set()

    def take(self, path: str) -> tuple[int, bool, int | None, bool]:
        """The faults for one request to ``path``: ``(short_by, ignore_range, status, hang)``."""
        with self._lock:
            active = bool(self.short_by or self.ignore_range or self.status or self.hang)
            if not active or not path.split("?", 1)[0].endswith(self.suffix):
                return 0, False, None, False
            if self.count is not None:
                if self.count <= 0:
                    return 0, False, None, False
                self.count -= 1
            self.hit += 1
            return self.short_by, self.ignore_range, self.status, self.hang


class _QuietServer(ThreadingHTTPServer):
    """Clients hanging up mid-response (a loader shutting down) are normal here, not errors."""

    daemon_threads = True
    # socketserver's default backlog of 5 drops concurrent connects (clients then retry after 1-7 s),
    # which a loader opening many ranged reads at once would measure as storage latency.
    request_queue_size = 128

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.connections: set[socket.socket] = set()
        self.conn_lock = threading.Lock()
        self.stopping = threading.Event()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError | OSError):
            super().handle_error(request, client_address)


class LoopbackServer:
    """Handle on a running server: ``url`` is the base URL (no trailing slash)."""

    def __init__(self, httpd: _QuietServer, stats: ServerStats, faults: Faults) -> None:
        self._httpd = httpd
        self.stats = stats
        self.faults = faults
        host, port = httpd.server_address[:2]
        self.url = f"http://{host}:{port}"
        self._closed = False

    def kill(self) -> None:
        """Die now, as a crashed server does: stop listening (new connections are refused) and
        reset every open connection, keep-alive ones included, mid-response or not."""
        if self._closed:
            return
        self._closed = True
        self._httpd.stopping.set()
        self._httpd.shutdown()
        # shutdown, not just close: a forked child (a loader worker) holds a copy of the listening
        # socket, and while any copy is open the kernel would go on accepting connections that
        # nobody answers; shutdown stops the socket itself, so new connections are refused
        with contextlib.suppress(OSError):
            self._httpd.socket.shutdown(socket.SHUT_RDWR)
        self._httpd.server_close()
        with self._httpd.conn_lock:
            conns = list(self._httpd.connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def _make_handler(
    root: Path,
    stats: ServerStats,
    latency_s: float,
    bandwidth: float | None,
    link: SharedLink | None,
    faults: Faults,
):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in separate writes; with Nagle on, the body would wait for the
            # client's delayed ACK (~40 ms on Linux loopback) and overstate every request's latency.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.server.conn_lock:
                self.server.connections.add(self.connection)

        def finish(self) -> None:
            with self.server.conn_lock:
                self.server.connections.discard(self.connection)
            with contextlib.suppress(OSError):
                super().finish()

        def log_message(self, format: str, *args) -> None:  # quiet: tests read stats instead
            pass

        def _resolve(self) -> Path | None:
            rel = self.path.split("?", 1)[0].lstrip("/")
            path = (root / rel).resolve()
            if root not in path.parents and path != root:
                return None
            return path if path.is_file() else None

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            if latency_s:
                time.sleep(latency_s)
            short_by, ignore_range, status, hang = faults.take(self.path)
            if hang:  # answer nothing; the connection stays open until the server stops
                while not self.server.stopping.wait(0.05) and faults.hang:
                    pass
                self.close_connection = True
                return
            if status is not None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                stats.record(self.path, 0, False)
                self.end_headers()
                return
            path = self._resolve()
            if path is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                stats.record(self.path, 0, False)
                self.end_headers()
                return
            size = path.stat().st_size
            start, end, ranged = 0, size - 1, False
            header = None if ignore_range else self.headers.get("Range")
            if header:
                m = _RANGE.match(header.strip())
                if m and (m.group(1) or m.group(2)):
                    ranged = True
                    if m.group(1):
                        start = int(m.group(1))
                        end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                    else:  # suffix range: last N bytes
                        start = max(0, size - int(m.group(2)))
                if start >= size and size > 0:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    stats.record(self.path, 0, True)
                    self.end_headers()
                    return
            length = max(0, end - start + 1)
            if short_by:  # cut short, and say so consistently: headers match the short body
                length = max(0, length - short_by)
                end = start + length - 1
            self.send_response(206 if ranged else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(length))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            stats.record(self.path, 0, ranged)
            self.end_headers()
            if not body:
                return
            sent = 0
            with open(path, "rb") as f:
                f.seek(start)
                t0 = time.perf_counter()
                while sent < length:
                    chunk = f.read(min(_CHUNK, length - sent))
                    if not chunk:
                        break
                    done_at = link.reserve(len(chunk)) if link is not None else None
                    stats.add_bytes(len(chunk))
                    self.wfile.write(chunk)
                    sent += len(chunk)
                    if done_at is not None:
                        time.sleep(max(0.0, done_at - time.perf_counter()))
                    if bandwidth:
                        ahead = sent / bandwidth - (time.perf_counter() - t0)
                        if ahead > 0:
                            time.sleep(ahead)

    return Handler


@contextlib.contextmanager
def serve_directory(
    root: str | os.PathLike,
    *,
    latency_s: float = 0.0,
    bandwidth_bytes_per_s: float | None = None,
    link_bytes_per_s: float | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[LoopbackServer]:
    """Serve ``root`` over HTTP on loopback for the duration of the ``with`` block.

    ``latency_s`` is added to every request (like an object store's first-byte latency);
    ``bandwidth_bytes_per_s`` caps each response's rate; ``link_bytes_per_s`` caps all responses
    together (one storage link shared by every connection). ``server.faults`` and
    ``server.kill()`` inject failures while it runs (see ``Faults``).
    """
    stats = ServerStats()
    faults = Faults()
    link = SharedLink(link_bytes_per_s) if link_bytes_per_s else None
    handler = _make_handler(Path(root).resolve(), stats, latency_s, bandwidth_bytes_per_s, link, faults)
    httpd = _QuietServer((host, port), handler)
    thread = threading.Thread(target=httpd.serve_forever, name="stallfree-httpserve", daemon=True)
    thread.start()
    server = LoopbackServer(httpd, stats, faults)
    try:
        yield server
    finally:
        server.close()
        thread.join(timeout=5)
