"""Slow storage on purpose, for benchmarks: the loopback HTTP server of ``stallfree.testing.httpserve``
with two additions, wrapped here rather than changed there:

- ``TCP_NODELAY`` on every connection. The base handler writes headers and body separately; with
  Nagle's algorithm on, the body waits for the client's delayed ACK, which adds ~40 ms to every
  request on Linux loopback, so "20 ms per request" would really be ~60 ms.
- an optional aggregate bandwidth cap shared by all connections (a storage link of S bytes/s),
  beside the base server's per-response cap; concurrency then cannot buy more than S, which is
  the storage the what-if model's S describes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from stallfree.testing import httpserve


class _SharedLink:
    """A token bucket over all responses: each write waits until the link could have carried it."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"aggregate bandwidth must be positive, got {bytes_per_s}")
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = time.perf_counter()

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes`` on the link; returns the time at which they have passed."""
        with self._lock:
            start = max(self._free_at, time.perf_counter())
            self._free_at = start + nbytes / self.rate
            return self._free_at


class _PacedWriter:
    """File-like wrapper over a handler's ``wfile`` that paces body writes through the link."""

    def __init__(self, raw: Any, link: _SharedLink) -> None:
        self._raw, self._link = raw, link

    def write(self, data: bytes) -> int:
        done_at = self._link.reserve(len(data))
        written = self._raw.write(data)
        delay = done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _handler(root: Path, stats: httpserve.ServerStats, latency_s: float, per_response: float | None, link):
    base = httpserve._make_handler(root, stats, latency_s, per_response)

    class Handler(base):  # type: ignore[misc, valid-type]
        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def end_headers(self) -> None:
            if isinstance(self.wfile, _PacedWriter):  # a kept-alive connection's next request
                self.wfile = self.wfile._raw
            super().end_headers()
            if link is not None:  # headers go out unpaced; the body shares the link
                self.wfile = _PacedWriter(self.wfile, link)

        def finish(self) -> None:
            if isinstance(self.wfile, _PacedWriter):
                self.wfile = self.wfile._raw
            super().finish()

    return Handler


class _QuietServer(ThreadingHTTPServer):
    """Clients that hang up mid-response (a loader shutting down) are normal here, not errors."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve_slow(
    root: str | os.PathLike,
    *,
    latency_s: float = 0.0,
    bandwidth_bytes_per_s: float | None = None,
    aggregate_bytes_per_s: float | None = None,
    host: str = "127.0.0.1",
) -> Iterator[httpserve.LoopbackServer]:
    """Serve ``root`` on loopback with ``latency_s`` per request, an optional per-response cap and an
    optional cap shared by all responses. Yields the base server handle (``.url``, ``.stats``)."""
    stats = httpserve.ServerStats()
    link = _SharedLink(aggregate_bytes_per_s) if aggregate_bytes_per_s else None
    handler = _handler(Path(root).resolve(), stats, latency_s, bandwidth_bytes_per_s, link)
    httpd = _QuietServer((host, 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, name="stallfree-slowstore", daemon=True)
    thread.start()
    server = httpserve.LoopbackServer(httpd, stats)
    try:
        yield server
    finally:
        server.close()
        thread.join(timeout=5)
