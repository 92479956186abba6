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
    # Lua text of the client's own (issue 36): an endless loop answered every client BUSY, and
    # string.rep grew a 256 MB server to 5 GB; clients may only FCALL the admin-loaded functions
    ("EVAL", "while true do end", "0"),
    ("EVAL", "return string.rep('x', 1500000000)", "0"),
    ("EVALSHA", "a" * 40, "0"),
    ("SCRIPT", "LOAD", "return 1"),
    ("FUNCTION", "LOAD", "#!lua name=mine\nredis.register_function('spin', function() while true do end end)"),
    ("FUNCTION", "FLUSH"),
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


def test_a_planted_oversized_value_is_never_downloaded(redis_servers):
    """A value over the client's max_entry_bytes (planted by anyone holding the data password) is
    left on the server unread, counted ``oversized`` and deleted: the client never receives it."""
    (server,) = redis_servers(1, password="pw", capacity_bytes=64 << 20)
    cache = ClusterCache([server.url], password="pw", max_entry_bytes=1 << 20)
    good, planted = CacheKey("fp", 1, "raw"), CacheKey("fp", 2, "raw")
    cache.put_many([(good, b"ok")])
    client = redis.Redis(host=server.host, port=server.port, password="pw")
    client.set(planted.to_bytes(), b"x" * (8 << 20))
    admin = redis.Redis(host=server.host, port=server.port, username=ADMIN_USER, password=server.admin_password)
    sent_before = int(admin.info("stats")["total_net_output_bytes"])
    assert cache.get_many([planted, good]) == [None, b"ok"]
    assert int(admin.info("stats")["total_net_output_bytes"]) - sent_before < 1 << 20
    assert cache.stats()["oversized"] == 1
    assert client.exists(planted.to_bytes()) == 0


def test_a_restricted_server_without_the_functions_is_named_unusable(redis_servers, caplog):
    """A server that lost its functions (restarted by hand, say) cannot get them from a data
    client: its keys are misses and the log says how to fix it, never an EVAL fallback."""
    (server,) = redis_servers(1, password="pw")
    admin = redis.Redis(host=server.host, port=server.port, username=ADMIN_USER, password=server.admin_password)
    admin.function_flush()
    cache = ClusterCache([server.url], password="pw")
    key = CacheKey("fp", 1, "raw")
    with caplog.at_level("WARNING", logger="stallfree.cache.cluster"):
        cache.put_many([(key, b"x")])
        assert cache.get_many([key]) == [None]
    assert "no stallfree_v1 function library" in caplog.text and "stallfree cache serve" in caplog.text
    assert cache.stats()["servers"][server.url]["state"] == "down"


def test_an_unrestricted_server_gets_the_functions_from_its_first_client(redis_servers):
    """A Redis the user runs with a plain password: the first client loads the library itself."""
    (server,) = redis_servers(1, password="pw", restricted=False)
    plain = redis.Redis(host=server.host, port=server.port, password="pw")
    plain.function_flush()
    cache = ClusterCache([server.url], password="pw")
    key = CacheKey("fp", 1, "raw")
    cache.put_many([(key, b"payload")])
    assert cache.get_many([key]) == [b"payload"]
    names = [dict(zip(lib[::2], lib[1::2], strict=True))[b"library_name"] for lib in plain.function_list()]
    assert names == [b"stallfree_v1"]


HOSTILE_FCALLS = [
    # (function, keys, args, what the reply names)
    ("stallfree_admit_v1", ["sf/__used__", "sf/__full__", "a", "b", "c"], [0, b"1"], "one value per entry key"),
    ("stallfree_admit_v1", ["sf/__used__", "sf/__full__", "a"], ["lots", b"1"], "capacity must be"),
    ("stallfree_admit_v1", ["sf/__used__", "sf/__full__", "a"], [-5, b"1"], "capacity must be"),
    ("stallfree_admit_v1", ["sf/__used__", "sf/__full__", "a"], ["nan", b"1"], "capacity must be"),
    ("stallfree_admit_v1", ["sf/__used__"], [], "one value per entry key"),
    ("stallfree_admit_v1", ["text", "sf/__full__", "a"], [0, b"1"], "used counter is not a number"),
    ("stallfree_drop_v1", ["text", "d"], [], "used counter is not an integer"),
    ("stallfree_sizes_v1", [], [], "wants the full key first"),
]


@pytest.mark.parametrize(("function", "keys", "args", "named"), HOSTILE_FCALLS)
def test_our_functions_called_with_hostile_arguments_change_nothing(redis_servers, function, keys, args, named):
    """A data client calling our functions with arguments of its own: a reply naming what is
    wrong and nothing written. Before, ``admit`` with fewer values than keys stored the first
    entries and then failed before counting them (the used counter no longer matched), and a
    negative or NaN capacity meant "no capacity"."""
    (server,) = redis_servers(1, password="pw", capacity_bytes=8 << 20)
    client = redis.Redis(host=server.host, port=server.port, password="pw")
    client.set("text", "not a number")
    client.set("d", "entry")
    before = {k: client.get(k) for k in ("sf/__used__", "sf/__full__", "a", "b", "c", "d", "text")}
    call = client.fcall_ro if function.startswith("stallfree_sizes") else client.fcall
    with pytest.raises(redis.ResponseError, match=named):
        call(function, len(keys), *keys, *args)
    assert {k: client.get(k) for k in before} == before
