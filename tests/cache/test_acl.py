"""A cache password grants the data commands only: the servers we start (``RedisServer``, and so
``stallfree cache serve``) refuse FLUSHALL, CONFIG, DEBUG, MODULE, SHUTDOWN and ACL changes to
cache clients, and keep them for a separate admin user with its own password."""

from __future__ import annotations

import pytest

from stallfree.cache.base import CacheKey
from stallfree.cache.cluster import ClusterCache
from stallfree.cache.server import ADMIN_USER

redis = pytest.importorskip("redis")

REFUSED = [
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("CONFIG", "SET", "maxmemory", "0"),
    ("CONFIG", "GET", "maxmemory"),
    ("DEBUG", "SLEEP", "0"),
    ("MODULE", "LIST"),
    ("SHUTDOWN", "NOSAVE"),
    ("ACL", "SETUSER", "default", "+@all"),
    ("KEYS", "*"),
    ("SCRIPT", "FLUSH"),
]


@pytest.mark.parametrize("password", ["pw-123", None], ids=["password", "no-password"])
def test_cache_clients_get_data_commands_only(redis_servers, password):
    (server,) = redis_servers(1, password=password, capacity_bytes=8 << 20)
    cache = ClusterCache([server.url], password=password)
    key = CacheKey("fp", 7, "raw")
    cache.put_many([(key, b"payload")])
    assert cache.get_many([key]) == [b"payload"]  # the data path, its Lua scripts included
    assert cache.stats()["servers"][server.url]["keys"] >= 1  # INFO and DBSIZE for stats

    client = redis.Redis(host=server.host, port=server.port, password=password)
    for command in REFUSED:
        # NOPERM from the ACL; DEBUG is also off in the server's own defaults, which say so first
        with pytest.raises(redis.exceptions.ResponseError, match="no permissions|DEBUG command not allowed"):
            client.execute_command(*command)
    assert client.ping()  # still up: SHUTDOWN was refused
    assert cache.get_many([key]) == [b"payload"]  # FLUSHALL was refused

    admin = redis.Redis(
        host=server.host, port=server.port, username=ADMIN_USER, password=server.admin_password
    )
    assert admin.config_get("maxmemory") == {"maxmemory": str(8 << 20)}
    assert server.admin_password_file.read_text().strip() == server.admin_password
    assert server.admin_password_file.stat().st_mode & 0o777 == 0o600
    assert server.admin_password != password


def test_a_restricted_server_keeps_its_policy_and_the_client_says_why(redis_servers, caplog):
    """A client asking for another policy cannot change the server's; it says so and goes on."""
    (server,) = redis_servers(1, password="pw", policy="minio")
    cache = ClusterCache([server.url], password="pw", policy="lru", capacity_bytes=1 << 20)
    cache.put_many([(CacheKey("fp", 1, "raw"), b"x")])
    assert cache.get_many([CacheKey("fp", 1, "raw")]) == [b"x"]
    assert cache.stats()["servers"][server.url]["maxmemory_policy"] == "noeviction"
    assert "cannot apply the lru policy's settings" in caplog.text
    assert "stallfree cache serve --policy lru" in caplog.text


def test_a_client_with_the_servers_policy_sends_no_config(redis_servers, caplog):
    (server,) = redis_servers(1, password="pw", policy="lru", capacity_bytes=4 << 20)
    cache = ClusterCache([server.url], password="pw", policy="lru", capacity_bytes=1 << 20)
    cache.put_many([(CacheKey("fp", 1, "raw"), b"x")])
    assert cache.get_many([CacheKey("fp", 1, "raw")]) == [b"x"]
    assert "cannot apply" not in caplog.text
