"""``stallfree cache serve`` / ``stallfree cache stats`` against real redis-server processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from stallfree.cache.base import CacheKey
from stallfree.cache.cluster import ClusterCache
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
        assert row["maxmemory_policy"] == "allkeys-lru"
        assert row["keys"] == 1
        assert row["keyspace_hits"] >= 1 and row["keyspace_misses"] >= 1
        assert 0 < row["hit_rate"] < 1

        assert main(["cache", "stats", url, "--password", "pw"]) == 0
        table = capsys.readouterr().out
        assert "allkeys-lru" in table and url in table

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
