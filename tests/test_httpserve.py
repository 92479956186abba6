"""The loopback HTTP server tests and benchmarks read through: exact ranges, Nagle off, a shared link."""

from __future__ import annotations

import socket
import time

import fsspec
import pytest

from stallfree.testing.httpserve import SharedLink, serve_directory


def test_serves_exact_byte_ranges_with_stats(tmp_path):
    payload = bytes(range(256)) * 400
    (tmp_path / "a.bin").write_bytes(payload)
    with serve_directory(tmp_path, latency_s=0.001, link_bytes_per_s=50e6) as server:
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        assert fs.cat_file(f"{server.url}/a.bin", start=1000, end=71000) == payload[1000:71000]
        assert fs.cat_file(f"{server.url}/a.bin") == payload
        deadline = time.monotonic() + 5  # the server records a response just after sending it
        while server.stats.requests < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.stats.range_requests >= 1
        assert server.stats.bytes_sent >= 70000 + len(payload)
        with pytest.raises(FileNotFoundError):
            fs.cat_file(f"{server.url}/missing.bin")


def test_connections_have_nagle_off(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    with serve_directory(tmp_path) as server:
        host, port = server.url.removeprefix("http://").split(":")
        seen = []
        handler = server._httpd.RequestHandlerClass
        original = handler.setup

        def spy(self):
            original(self)
            seen.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        handler.setup = spy
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(b"GET /a.bin HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            body = b""
            while chunk := conn.recv(4096):
                body += chunk
        assert body.endswith(b"x" * 10)
        assert seen and seen[0] != 0


def test_shared_link_books_bytes_back_to_back():
    link = SharedLink(1000.0)
    first = link.reserve(500)
    second = link.reserve(1000)
    assert second - first == pytest.approx(1.0)
    with pytest.raises(ValueError, match="positive"):
        SharedLink(0)
