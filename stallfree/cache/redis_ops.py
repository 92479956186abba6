"""The Redis side of the cluster tier: server URLs, key ownership, server scripts, status.

Kept apart from ``ClusterCache`` (the client-side policy and fault handling) so each stays small.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

USED_KEY = b"sf/__used__"
FULL_KEY = b"sf/__full__"

# KEYS[1] used counter, KEYS[2] full flag, KEYS[3..] entries; ARGV[1] capacity (0: none), ARGV[2..] values.
# Returns per entry: 1 stored, 0 already present, -1 no room.
ADMIT_LUA = """
local cap = tonumber(ARGV[1])
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local out = {}
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    out[#out + 1] = 0
  else
    local n = string.len(ARGV[i - 1])
    if cap > 0 and used + n > cap then
      out[#out + 1] = -1
    else
      redis.call('SET', KEYS[i], ARGV[i - 1])
      used = used + n
      out[#out + 1] = 1
    end
  end
end
redis.call('SET', KEYS[1], used)
for i = 1, #out do
  if out[i] == -1 then redis.call('SET', KEYS[2], '1') break end
end
return out
"""

# KEYS[1] used counter, KEYS[2..] entries to drop.
DROP_LUA = """
local freed = 0
for i = 2, #KEYS do
  local n = redis.call('STRLEN', KEYS[i])
  if n > 0 then redis.call('DEL', KEYS[i]) freed = freed + n end
end
if freed > 0 and redis.call('EXISTS', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[1], freed) end
return freed
"""


class ClusterCacheError(RuntimeError):
    """Raised only by ``ClusterCache.check()``: which servers cannot be used, and why."""


def parse_server(url: str) -> tuple[str, dict[str, Any]]:
    """``redis://[user:pass@]host:port[/db]``, ``rediss://...`` (TLS) or ``host:port`` ->
    (identity ``host:port``, connection keyword arguments)."""
    if "://" not in url:
        url = f"redis://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"cannot read cache server {url!r}; expected redis://host:port")
    kwargs: dict[str, Any] = {"host": parts.hostname, "port": parts.port or 6379}
    path = parts.path.strip("/")
    if path:
        kwargs["db"] = int(path)
    if parts.password:
        kwargs["password"] = unquote(parts.password)
    if parts.username:
        kwargs["username"] = unquote(parts.username)
    if parts.scheme == "rediss":
        kwargs["ssl"] = True
    return f"{parts.hostname}:{kwargs['port']}", kwargs


def rendezvous_rank(key: bytes, idents: Sequence[bytes]) -> list[int]:
    """Server positions ordered by highest random weight for ``key`` (first = owner)."""
    weights = [
        int.from_bytes(hashlib.blake2b(key, digest_size=8, key=ident[:64]).digest(), "little")
        for ident in idents
    ]
    return sorted(range(len(idents)), key=lambda i: (-weights[i], idents[i]))


def is_oom(exc: BaseException) -> bool:
    """A "full" reply: the server refuses writes above its ``maxmemory``."""
    import redis

    oom = getattr(redis.exceptions, "OutOfMemoryError", ())
    return (bool(oom) and isinstance(exc, oom)) or str(exc).startswith("OOM") or "maxmemory" in str(exc)


def connect(kwargs: dict[str, Any]) -> Any:
    """A client that never retries: a dead server costs one timeout, then the caller decides."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(**kwargs, retry=Retry(NoBackoff(), 0))


def failure_reason(exc: BaseException) -> str:
    """Why a server could not be used; a wrong or missing password is named as such."""
    import redis

    if isinstance(exc, redis.AuthenticationError) or "auth" in str(exc).lower():
        return f"authentication failed (check the cache password): {exc}"
    return f"{type(exc).__name__}: {exc}"


def mget_and_full(client: Any, keys: list[bytes]) -> tuple[list[bytes | None], bool]:
    pipe = client.pipeline(transaction=False)
    pipe.mget(keys)
    pipe.exists(FULL_KEY)
    values, full = pipe.execute()
    return values, bool(full)


def server_info(client: Any) -> dict[str, Any]:
    info = client.info()
    used = client.get(USED_KEY)
    return {
        "used_memory": int(info.get("used_memory", 0)),
        "maxmemory": int(info.get("maxmemory", 0)),
        "maxmemory_policy": str(info.get("maxmemory_policy", "")),
        "keys": int(client.dbsize()),
        "cached_bytes": int(used) if used is not None else None,
        "evicted_keys": int(info.get("evicted_keys", 0)),
        "keyspace_hits": int(info.get("keyspace_hits", 0)),
        "keyspace_misses": int(info.get("keyspace_misses", 0)),
        "run_id": str(info.get("run_id", "")),
    }


def server_status(
    url: str, password: str | None = None, timeout_s: float = 2.0, tls_ca_certs: str | None = None
) -> dict[str, Any]:
    """Usage and hit counters of one cache server (``stallfree cache stats``).

    Raises ``ClusterCacheError`` with the reason when the server cannot be reached or refuses us.
    """
    import redis

    _, kwargs = parse_server(url)
    if password is not None:
        kwargs.setdefault("password", password)
    if kwargs.get("ssl") and tls_ca_certs is not None:
        kwargs["ssl_ca_certs"] = tls_ca_certs
    client = connect({**kwargs, "socket_connect_timeout": timeout_s, "socket_timeout": timeout_s})
    try:
        status = server_info(client)
    except redis.RedisError as exc:
        raise ClusterCacheError(f"{url}: {failure_reason(exc)}") from exc
    finally:
        client.close()
    lookups = status["keyspace_hits"] + status["keyspace_misses"]
    status["hit_rate"] = status["keyspace_hits"] / lookups if lookups else 0.0
    status["url"] = url
    return status
