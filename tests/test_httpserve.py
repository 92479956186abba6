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


def _get(server, path, headers=()):
    """One raw HTTP/1.1 GET: (status line, headers dict, body), read to the connection's close."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n".encode())
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    return lines[0], {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}, body


def test_fault_modes(tmp_path):
    payload = bytes(range(256)) * 40
    (tmp_path / "a.tar").write_bytes(payload)
    (tmp_path / "a.idx").write_bytes(b"index")
    rng = (("Range", "bytes=100-1099"),)
    with serve_directory(tmp_path) as server:
        server.faults.set(short_by=7, suffix=".tar")
        status, hdr, body = _get(server, "/a.tar", rng)
        # a consistent liar: the headers describe the short body
        assert status.endswith("206 Partial Content") and body == payload[100:1093]
        assert hdr["content-length"] == "993" and hdr["content-range"] == f"bytes 100-1092/{len(payload)}"
        assert _get(server, "/a.idx")[2] == b"index"  # another suffix: served normally
        server.faults.set(ignore_range=True)
        status, hdr, body = _get(server, "/a.tar", rng)
        assert status.endswith("200 OK") and body == payload and "content-range" not in hdr
        server.faults.set(status=503, count=1)
        assert _get(server, "/a.tar", rng)[0].endswith("503 Service Unavailable")
        assert _get(server, "/a.tar", rng)[2] == payload[100:1100]  # count spent: normal again
        assert server.faults.hit == 1
        with pytest.raises(TypeError, match="unknown fault"):
            server.faults.set(shrt_by=7)
        url = server.url
        server.kill()
        host, port = url.removeprefix("http://").split(":")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=5)
