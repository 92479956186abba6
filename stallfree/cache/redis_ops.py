"""The Redis side of the cluster tier: server URLs, key ownership, status (the server-side
functions are in ``redis_functions.py``).

Kept apart from ``ClusterCache`` (the client-side policy and fault handling) so each stays small.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from stallfree.extras import require

USED_KEY = b"sf/__used__"
FULL_KEY = b"sf/__full__"


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
    redis = require("redis", "redis", "connecting to a cache server")
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(**kwargs, retry=Retry(NoBackoff(), 0))


def failure_reason(exc: BaseException) -> str:
    """Why a server could not be used; a wrong or missing password is named as such."""
    import redis

    if isinstance(exc, redis.AuthenticationError) or "auth" in str(exc).lower():
        return f"authentication failed (check the cache password): {exc}"
    return f"{type(exc).__name__}: {exc}"


def server_info(client: Any) -> dict[str, Any]:
    info = client.info()
    used = client.get(USED_KEY)
    redis_policy = str(info.get("maxmemory_policy", ""))
    return {
        "used_memory": int(info.get("used_memory", 0)),
        "maxmemory": int(info.get("maxmemory", 0)),
        "policy": policy_of_server(redis_policy),
        "maxmemory_policy": redis_policy,
        "keys": int(client.dbsize()),
        "cached_bytes": int(used) if used is not None else None,
        "evicted_keys": int(info.get("evicted_keys", 0)),
        "keyspace_hits": int(info.get("keyspace_hits", 0)),
        "keyspace_misses": int(info.get("keyspace_misses", 0)),
        "run_id": str(info.get("run_id", "")),
    }


def policy_of_server(maxmemory_policy: str) -> str:
    """Our cache policy a server's ``maxmemory-policy`` stands for (``noeviction`` is ``minio``,
    ``allkeys-lru`` is ``lru``); any other setting is shown as Redis names it."""
    from stallfree.cache.policy import POLICIES

    for policy in POLICIES.values():
        if policy.redis_maxmemory_policy == maxmemory_policy:
            return policy.name
    return f"redis:{maxmemory_policy}"


def server_status(
    url: str, password: str | None = None, timeout_s: float = 2.0, tls_ca_certs: str | None = None
) -> dict[str, Any]:
    """Usage and hit counters of one cache server (``stallfree cache stats``).

    Raises ``ClusterCacheError`` with the reason when the server cannot be reached or refuses us.
    """
    redis = require("redis", "redis", "server_status (stallfree cache stats)")

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
