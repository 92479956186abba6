"""``stallfree cache serve`` / ``stallfree cache stats`` against real redis-server processes."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stallfree.cache.base import CacheKey
from stallfree.cache.cluster import ClusterCache
from stallfree.cache.credentials import ensure_secret_file
from stallfree.cache.server import free_port, parse_size
from stallfree.cli import main


def test_parse_size():
    assert parse_size("8GB") == 8_000_000_000
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5kb") == 1500
    assert parse_size("1234") == 1234
    with pytest.raises(ValueError, match="cannot read size '8 parsecs'"):
        parse_size("8 parsecs")


def test_serve_prints_url_applies_config_and_stops(tmp_path, capsys):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stallfree",
            "cache",
            "serve",
            "--port",
            str(port),
            "--capacity",
            "3MB",
            "--policy",
            "lru",
            "--password",
            "pw",
            "--dir",
            str(tmp_path / "srv"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url == f"redis://127.0.0.1:{port}"
        cache = ClusterCache([url], policy="lru", password="pw", configure_servers=False)
        cache.put_many([(CacheKey("fp", 1, "raw"), b"abc")])
        assert cache.get_many([CacheKey("fp", 1, "raw"), CacheKey("fp", 2, "raw")]) == [b"abc", None]

        assert main(["cache", "stats", url, "--password", "pw", "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert row["maxmemory"] == 3_000_000
        assert row["maxmemory_policy"] == "allkeys-lru" and row["policy"] == "lru"
        assert row["keys"] == 1
        assert row["keyspace_hits"] >= 1 and row["keyspace_misses"] >= 1
        assert 0 < row["hit_rate"] < 1

        assert main(["cache", "stats", url, "--password", "pw"]) == 0
        table = capsys.readouterr().out
        assert re.search(rf"^{re.escape(url)}\s+lru\s", table, re.M)

        assert main(["cache", "stats", url, "--password", "nope", "--json"]) == 1
        (row,) = json.loads(capsys.readouterr().out)
        assert "authentication failed" in row["error"]
        conf = (tmp_path / "srv" / "redis.conf").read_text()
        assert 'save ""' in conf and "appendonly no" in conf and "bind 127.0.0.1" in conf
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert main(["cache", "stats", url, "--timeout", "0.5"]) == 1
    assert "unreachable" in capsys.readouterr().out


def test_serve_rejects_bad_capacity(capsys):
    assert main(["cache", "serve", "--capacity", "lots"]) == 2
    assert "cannot read size 'lots'" in capsys.readouterr().err
    assert main(["cache", "serve", "--capacity", "0"]) == 2  # Redis reads maxmemory 0 as "no limit"
    assert "--capacity must be more than 0, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize("bind", ["999.1.1.1", "192.0.2.1"])
def test_serve_names_an_address_it_cannot_listen_on(bind):
    """Not an address, or no address of this machine (TEST-NET-1: nothing is sent there, the
    kernel refuses the bind): one line, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "stallfree", "cache", "serve", "--port", "0", "--bind", bind],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"stallfree cache serve: error: cannot listen on {bind!r}" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""



@pytest.mark.parametrize("port", ["70000", "-1"])
def test_serve_names_a_port_out_of_range(port, capsys):
    """redis-server's own config dump (">>> 'port 70000'") was all the user saw."""
    assert main(["cache", "serve", "--port", port]) == 2
    assert f"port must be from 0 to 65535 (0: any free port), got {port}" in capsys.readouterr().err


def test_an_ipv6_loopback_server_on_any_port_is_reachable_at_its_url(redis_servers):
    """``--bind ::1 --port 0`` picked its port with an IPv4 socket (``socket.gaierror``
    traceback), and the URL was ``redis://::1:PORT``, which no client parses."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    (server,) = redis_servers(1, bind="::1", password="pw")
    assert server.url == f"redis://[::1]:{server.port}"
    cache = ClusterCache([server.url], password="pw")
    key = CacheKey("fp", 1, "raw")
    cache.put_many([(key, b"over v6")])
    assert cache.get_many([key]) == [b"over v6"]

def test_stats_names_our_policy_not_redis_setting(redis_servers, capsys):
    """A minio server runs Redis's noeviction; stats says minio (the user's word for it)."""
    (server,) = redis_servers(1, password="pw", policy="minio")
    assert main(["cache", "stats", server.url, "--password", "pw", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["policy"], row["maxmemory_policy"]) == ("minio", "noeviction")


class Serve:
    """``stallfree cache serve ARGS`` as a subprocess; its stderr lines collected on a thread so a
    missing line fails the test after ``timeout`` instead of hanging it."""

    def __init__(self, *args: str, timeout: float = 60.0) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "stallfree", "cache", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.timeout = timeout
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + self.timeout
        while True:
            for line in self.seen:
                if m := re.search(pattern, line):
                    return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"serve never printed {pattern!r}; stderr: {self.seen}")
            try:
                self.seen.append(self.lines.get(timeout=left))
            except queue.Empty:
                pass

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def redis_pid(self) -> int:
        return int(self.wait_for(r"\(pid (\d+)\)").group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.proc.stdout.close()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an unreaped corpse holds no port or memory)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_serve_makes_a_private_password_by_default_and_clients_find_it(tmp_path, capsys, monkeypatch):
    import redis

    serve = Serve("--dir", str(tmp_path / "srv"), "--secret-file", str(tmp_path / "keys" / "secret"))
    try:
        password_file = Path(serve.wait_for(r"password file: (\S+)").group(1))
        assert password_file == tmp_path / "srv" / "password"
        assert password_file.stat().st_mode & 0o777 == 0o600
        secret_file = Path(serve.wait_for(r"secret file: (\S+)").group(1))
        assert secret_file.stat().st_mode & 0o777 == 0o600 and len(secret_file.read_text().strip()) >= 32
        serve.redis_pid()
        # a local process without the password can neither plant nor read
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=serve.port).set(b"sf/planted", b"x")
        cache = ClusterCache([serve.url], password_file=password_file, secret_file=secret_file)
        cache.put_many([(CacheKey("fp", 1, "raw"), b"abc")])
        assert cache.get_many([CacheKey("fp", 1, "raw")]) == [b"abc"]
        assert main(["cache", "stats", serve.url, "--password-file", str(password_file), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["keys"] >= 1
        monkeypatch.setenv("STALLFREE_CACHE_PASSWORD_FILE", str(password_file))
        assert main(["cache", "stats", serve.url, "--json"]) == 0
        capsys.readouterr()
        monkeypatch.delenv("STALLFREE_CACHE_PASSWORD_FILE")
        assert main(["cache", "stats", serve.url, "--json"]) == 1
        assert "authentication failed" in json.loads(capsys.readouterr().out)[0]["error"]
    finally:
        serve.stop()


def test_password_file_is_created_once_then_shared(tmp_path):
    path = tmp_path / "shared" / "cache.password"
    value, created = ensure_secret_file(path)
    assert created and path.read_text() == value + "\n" and path.stat().st_mode & 0o777 == 0o600
    assert ensure_secret_file(path) == (value, False)  # a second node reuses it


def test_serve_password_options_exclude_each_other(tmp_path, capsys):
    assert main(["cache", "serve", "--no-password", "--password", "pw", "--dir", str(tmp_path)]) == 2
    assert "--no-password excludes --password" in capsys.readouterr().err
    pw = tmp_path / "pw"
    assert (
        main(["cache", "serve", "--password", "pw", "--password-file", str(pw), "--dir", str(tmp_path)]) == 2
    )
    assert "--password and --password-file exclude each other" in capsys.readouterr().err
    assert main(["cache", "stats", "redis://127.0.0.1:1", "--password-file", str(pw)]) == 2
    assert "cannot read password file" in capsys.readouterr().err


def test_sigkill_of_serve_takes_its_redis_server_down(tmp_path):
    serve = Serve("--dir", str(tmp_path / "srv"))
    pid = serve.redis_pid()
    try:
        assert alive(pid)
        serve.proc.send_signal(signal.SIGKILL)
        serve.proc.wait(30)
        deadline = time.monotonic() + 30  # a hang bound, not a timing threshold
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), f"redis-server {pid} outlived its killed 'stallfree cache serve'"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        serve.stop()
