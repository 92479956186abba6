"""Cluster tier: one Redis server per node; rendezvous hashing gives every key one owner.

With highest-random-weight hashing each key ranks the servers by ``hash(server, key)``; the top one
owns it, so N nodes hold the dataset once and each holds about 1/N of it. Under ``minio`` a server
that is full hands new keys to the next server in the key's ranking (and readers follow the same
chain), so the cluster fills completely even though hashing never splits keys exactly evenly.

Capacity under ``minio`` is exact and shared by all clients: a server-side function
(``redis_functions.py``, loaded by the server's admin user; clients may call it, never send Lua) admits an
entry only while the server's ``used`` counter plus its size fits ``capacity_bytes``. Under ``lru``
the server evicts (``allkeys-lru`` with ``maxmemory``). An out-of-memory reply means "full".

With a ``secret`` every entry is signed (HMAC-SHA256 over key and value, ``signing.py``) and an
entry that is unsigned or signed otherwise is a miss and deleted: a process that can reach a
server but lacks the secret cannot plant a sample.

Faults never reach the caller: a server that refuses connections, times out or fails to
authenticate is marked down by a per-server circuit breaker and its keys are misses; it is tried
again after an exponentially growing backoff, and used again once it answers (a restarted server is
simply empty).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from stallfree.cache import redis_functions
from stallfree.cache.base import MAX_ENTRY_BYTES, BaseCache, PutResult
from stallfree.cache.credentials import read_secret_file
from stallfree.cache.policy import Policy
from stallfree.cache.redis_ops import (
    FULL_KEY,
    USED_KEY,
    ClusterCacheError,
    connect,
    failure_reason,
    is_oom,
    parse_server,
    rendezvous_rank,
    server_info,
    server_status,
)
from stallfree.cache.signing import OVERHEAD, EntrySigner
from stallfree.extras import require

log = logging.getLogger(__name__)

__all__ = ["ClusterCache", "ClusterCacheError", "parse_server", "rendezvous_rank", "server_status"]

_MAX_PUT_BYTES = 8 << 20  # split large put batches into calls of about this size


@dataclass
class _Server:
    """Connection and circuit-breaker state of one server."""

    url: str
    ident: bytes  # what rendezvous hashing hashes: host:port, identical on every node
    kwargs: dict[str, Any]
    client: Any = None
    down_until: float = 0.0
    failures: int = 0
    full: bool = False
    full_until: float = 0.0
    configured: bool = False
    last_error: str = ""
    counts: dict[str, int] = field(
        default_factory=lambda: {"hits": 0, "misses": 0, "errors": 0, "admitted": 0}
    )


class ClusterCache(BaseCache):
    """A cache spread over Redis servers (one per node), each key owned by one server.

    ``capacity_bytes`` is the budget of encoded bytes *per server* (``None``: as the server's own
    ``maxmemory`` allows). ``password`` (or ``password_file``, as ``stallfree cache serve`` writes
    it)/``username`` apply to every server unless its URL has its own; ``secret`` (or
    ``secret_file``) signs every entry and accepts only entries signed with it; ``tls=True`` (or ``rediss://`` URLs) encrypts, with optional CA and client certificates.
    With ``configure_servers`` the servers' ``maxmemory-policy`` is set to match ``policy``
    (and, under ``lru``, an unlimited ``maxmemory`` to ``capacity_bytes`` above current use).
    ``connect_timeout_s``/``timeout_s`` bound every call (a slow server becomes misses);
    a failing server is skipped for ``backoff_s`` doubling up to ``max_backoff_s``. ``spill``
    (minio only) lets a full owner hand keys to the next server in the key's ranking; ``parallel``
    talks to the servers of one batch concurrently. ``max_entry_bytes`` bounds one entry
    (``base.MAX_ENTRY_BYTES``, 64 MiB, by default; the signature's 36 bytes not counted).
    """

    name = "cluster"

    def __init__(
        self,
        servers: Sequence[str],
        capacity_bytes: int | None = None,
        policy: str | Policy = "minio",
        *,
        password: str | None = None,
        username: str | None = None,
        password_file: str | os.PathLike | None = None,
        secret: bytes | str | None = None,
        secret_file: str | os.PathLike | None = None,
        tls: bool = False,
        tls_ca_certs: str | None = None,
        tls_certfile: str | None = None,
        tls_keyfile: str | None = None,
        tls_verify: bool = True,
        connect_timeout_s: float = 0.5,
        timeout_s: float = 2.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        full_recheck_s: float = 30.0,
        configure_servers: bool = True,
        spill: bool = True,
        parallel: bool = True,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        super().__init__()
        require("redis", "redis", "ClusterCache")  # a missing client library: a setup error, not a miss
        if isinstance(servers, str):
            servers = [servers]
        if not servers:
            raise ValueError("ClusterCache needs at least one server URL")
        self._set_budget(capacity_bytes, policy, max_entry_bytes)
        self.servers = list(servers)
        if password is not None and password_file is not None:
            raise ValueError("give ClusterCache a password or a password_file, not both")
        if secret is not None and secret_file is not None:
            raise ValueError("give ClusterCache a secret or a secret_file, not both")
        self.password = read_secret_file(password_file, "password") if password_file is not None else password
        self.secret = read_secret_file(secret_file, "secret") if secret_file is not None else secret
        self._signer = EntrySigner(self.secret) if self.secret is not None else None
        self.username = username
        self.tls = tls
        self.tls_ca_certs = tls_ca_certs
        self.tls_certfile = tls_certfile
        self.tls_keyfile = tls_keyfile
        self.tls_verify = tls_verify
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.full_recheck_s = full_recheck_s
        self.configure_servers = configure_servers
        self._spill_requested = spill
        self.spill = spill and not self.policy.evicts  # lru servers make room instead
        self._nodes = [self._make_server(url) for url in self.servers]
        self._chain = len(self._nodes) if self.spill else 1  # servers a key may live on, in rank order
        self._idents = [n.ident for n in self._nodes]
        if len(set(self._idents)) != len(self._idents):
            raise ValueError(f"duplicate cache servers in {self.servers}")
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.parallel = parallel
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = -1

    def _config(self) -> dict[str, Any]:
        names = (
            "servers capacity_bytes password username secret tls tls_ca_certs tls_certfile tls_keyfile tls_verify "
            "connect_timeout_s timeout_s backoff_s max_backoff_s full_recheck_s configure_servers parallel "
            "max_entry_bytes"
        ).split()
        cfg = {n: getattr(self, n) for n in names}
        cfg["policy"] = self.policy.name
        cfg["spill"] = self._spill_requested
        return cfg

    def _make_server(self, url: str) -> _Server:
        ident, kwargs = parse_server(url)
        if self.password is not None:
            kwargs.setdefault("password", self.password)
        if self.username is not None:
            kwargs.setdefault("username", self.username)
        if self.tls or kwargs.get("ssl"):
            kwargs["ssl"] = True
            kwargs["ssl_ca_certs"] = self.tls_ca_certs
            kwargs["ssl_certfile"] = self.tls_certfile
            kwargs["ssl_keyfile"] = self.tls_keyfile
            kwargs["ssl_cert_reqs"] = "required" if self.tls_verify else "none"
            kwargs["ssl_check_hostname"] = self.tls_verify
        kwargs["socket_connect_timeout"] = self.connect_timeout_s
        kwargs["socket_timeout"] = self.timeout_s
        return _Server(url=url, ident=ident.encode(), kwargs=kwargs)

    # -- connections and the circuit breaker ------------------------------------------------------
    def _client(self, node: _Server) -> Any | None:
        """The node's client, or ``None`` while its breaker is open."""
        if os.getpid() != self._pid:  # forked: drop the parent's sockets
            with self._lock:
                if os.getpid() != self._pid:
                    for n in self._nodes:
                        n.client = None
                        n.configured = False
                    self._pid = os.getpid()
        now = time.monotonic()
        if node.down_until > now:
            return None
        if node.client is None:
            node.client = connect(node.kwargs)
        if not node.configured:
            self._configure(node)
        return node.client

    def _configure(self, node: _Server) -> None:
        """Match the server's eviction settings to our policy (once per connection)."""
        import redis

        node.configured = True
        node.client.ping()  # raises (and trips the breaker) when the server is unusable
        redis_functions.ensure(node.client)  # likewise when it lacks them and we may not load them
        if not self.configure_servers:
            return
        try:
            # INFO first: a server from ``stallfree cache serve`` is already set up for its policy
            # and refuses CONFIG to cache clients (its ACL), so ask only for what differs
            memory = node.client.info("memory")
            wanted = self.policy.redis_maxmemory_policy
            if str(memory.get("maxmemory_policy", "")) != wanted:
                node.client.config_set("maxmemory-policy", wanted)
            if self.policy.evicts and self.capacity_bytes and int(memory.get("maxmemory", 0) or 0) == 0:
                node.client.config_set("maxmemory", int(memory.get("used_memory", 0)) + self.capacity_bytes)
        except redis.ResponseError as exc:  # NOPERM from a restricted server among them
            log.warning(
                "cache server %s: cannot apply the %s policy's settings (%s); using it as configured "
                "(start it with `stallfree cache serve --policy %s`)",
                node.url,
                self.policy.name,
                exc,
                self.policy.name,
            )

    def _failed_node(self, node: _Server, exc: BaseException) -> None:
        """Open the node's breaker: its keys are misses until the backoff has passed."""
        reason = failure_reason(exc)
        with self._lock:
            node.failures += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (node.failures - 1))
            node.down_until = time.monotonic() + delay
            node.configured = False
            node.last_error = reason
            node.counts["errors"] += 1
            client, node.client = node.client, None
        self._stats.add(errors=1)
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken connection may fail too; nothing to do
                pass
        level = logging.ERROR if "authentication" in reason else logging.WARNING
        log.log(level, "cache server %s unusable (retry in %.1fs): %s", node.url, delay, reason)

    def _ok(self, node: _Server) -> None:
        if node.failures:
            log.info("cache server %s is back", node.url)
            node.failures = 0
            node.last_error = ""

    def _is_full(self, node: _Server) -> bool:
        if node.full and node.full_until and time.monotonic() > node.full_until:
            node.full = False
        return node.full

    def _call(self, node: _Server, fn: Any) -> Any:
        """Run ``fn(client)`` against ``node``; ``None`` when the node is down or fails."""
        import redis

        client = self._client_or_fail(node)
        if client is None:
            return None
        try:
            result = fn(client)
        except redis.ResponseError as exc:
            if is_oom(exc):
                node.full, node.full_until = True, time.monotonic() + self.full_recheck_s
                log.info("cache server %s is full (%s); not admitting there", node.url, exc)
                return None
            self._failed_node(node, exc)
            return None
        except Exception as exc:  # ConnectionError, TimeoutError, AuthenticationError, OSError...
            self._failed_node(node, exc)
            return None
        self._ok(node)
        return result

    def _client_or_fail(self, node: _Server) -> Any | None:
        try:
            return self._client(node)
        except Exception as exc:
            self._failed_node(node, exc)
            return None

    # -- primitives --------------------------------------------------------------------------------
    def _ranks(self, keys: Sequence[bytes]) -> list[list[int]]:
        if len(self._nodes) == 1:
            return [[0]] * len(keys)
        return [rendezvous_rank(k, self._idents) for k in keys]

    def _each_server(self, groups: dict[int, list[int]], fn: Any) -> dict[int, Any]:
        """``fn(server, positions)`` for every group, concurrently when several servers are involved
        (one network round trip of wall time per level instead of one per server)."""
        if len(groups) <= 1 or not self.parallel:
            return {server: fn(server, positions) for server, positions in groups.items()}
        pool = self._executor()
        futures = {server: pool.submit(fn, server, positions) for server, positions in groups.items()}
        return {server: future.result() for server, future in futures.items()}

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(len(self._nodes), thread_name_prefix="stallfree-cluster")
                self._pool_pid = os.getpid()
            return self._pool

    def _get_raw(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        ranks = self._ranks(keys)
        pending = list(range(len(keys)))

        limit = self.max_entry_bytes + (OVERHEAD if self._signer is not None else 0)
        oversized: list[int] = []

        def fetch(server: int, positions: list[int]) -> Any:
            return self._call(
                self._nodes[server],
                lambda c: redis_functions.get_bounded(c, FULL_KEY, [keys[p] for p in positions], limit),
            )

        for level in range(self._chain):
            groups: dict[int, list[int]] = {}
            for pos in pending:
                groups.setdefault(ranks[pos][level], []).append(pos)
            pending = []
            replies = self._each_server(groups, fetch)
            for server, positions in groups.items():
                node, reply = self._nodes[server], replies[server]
                if reply is None:
                    node.counts["misses"] += len(positions)
                    continue
                values, full = reply.values, reply.full
                node.full = full or (node.full and bool(node.full_until))
                oversized += (positions[i] for i in reply.oversized)
                for pos, value in zip(positions, values, strict=True):
                    if value is not None:
                        out[pos] = value
                        node.counts["hits"] += 1
                    else:
                        node.counts["misses"] += 1
                        if node.full:  # a full server's keys may live further down the chain
                            pending.append(pos)
            if not pending:
                break
        if oversized:
            self._drop_oversized([keys[p] for p in oversized], limit)
        return self._open_signed(keys, out) if self._signer is not None else out

    def _drop_oversized(self, keys: list[bytes], limit: int) -> None:
        """Entries the server kept back for being over ``limit`` (never downloaded): counted as
        ``oversized`` and deleted, as the base class does with one it received."""
        if not self._stats["oversized"]:
            log.warning(
                "cluster: dropping %d entries over max_entry_bytes=%d, left on the server unread "
                "(further ones only counted)",
                len(keys),
                limit,
            )
        self._stats.add(oversized=len(keys))
        self._delete_raw(keys)

    def _open_signed(self, keys: Sequence[bytes], values: list[bytes | None]) -> list[bytes | None]:
        """Strip and check each entry's signature; unsigned or badly signed ones are deleted."""
        out: list[bytes | None] = []
        bad: list[bytes] = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                out.append(None)
                continue
            blob, why = self._signer.open(key, value)
            if blob is None:
                if not bad:
                    log.warning("cluster: dropping entry %r: %s", key, why)
                bad.append(key)
            out.append(blob)
        if bad:
            self._stats.add(corrupt=len(bad))
            self._delete_raw(bad)
        return out

    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> PutResult:
        if self._signer is not None:
            items = [(key, self._signer.sign(key, blob)) for key, blob in items]
        ranks = self._ranks([k for k, _ in items])
        admitted = nbytes = 0
        pending = list(range(len(items)))

        def store(server: int, positions: list[int]) -> list[tuple[list[int], list[int] | None]]:
            node = self._nodes[server]
            if node.down_until > time.monotonic():
                return []  # its keys are misses until it is back; never move them elsewhere
            return [
                (chunk, self._call(node, lambda c, ch=chunk: self._store(c, [items[p] for p in ch])))
                for chunk in _chunks(positions, items)
            ]

        for level in range(self._chain):
            groups: dict[int, list[int]] = {}
            for pos in pending:
                server = ranks[pos][level]
                skip = level + 1 < self._chain and self._is_full(self._nodes[server])
                groups.setdefault(-1 if skip else server, []).append(pos)
            pending = groups.pop(-1, [])  # owners known to be full: straight to the next in line
            results = self._each_server(groups, store)
            for server in groups:
                node = self._nodes[server]
                for chunk, status in results[server]:
                    if status is None:
                        if self._is_full(node) and node.down_until <= time.monotonic():
                            pending.extend(chunk)  # "OOM": try the next server in the chain
                        continue
                    for pos, st in zip(chunk, status, strict=True):
                        if st == 1:
                            admitted += 1
                            nbytes += len(items[pos][1])
                            node.counts["admitted"] += 1
                        elif st == -1:
                            node.full = True
                            pending.append(pos)
            if not pending:
                break
        return PutResult(admitted, nbytes, len(pending))

    def _store(self, client: Any, batch: list[tuple[bytes, bytes]]) -> list[int]:
        if self.policy.evicts:
            pipe = client.pipeline(transaction=False)
            for key, blob in batch:
                pipe.set(key, blob, nx=True)
            return [1 if ok else 0 for ok in pipe.execute()]
        keys = [USED_KEY, FULL_KEY, *(k for k, _ in batch)]
        return redis_functions.admit(client, keys, [self.capacity_bytes or 0, *(b for _, b in batch)])

    def _delete_raw(self, keys: Sequence[bytes]) -> None:
        groups: dict[int, list[bytes]] = {}
        for key, rank in zip(keys, self._ranks(keys), strict=True):
            for server in rank[: self._chain]:  # wherever a lookup may find it
                groups.setdefault(server, []).append(key)
        for server, mine in groups.items():
            node = self._nodes[server]
            self._call(node, lambda c, ks=mine: redis_functions.drop(c, [USED_KEY, *ks]))

    def _contains_raw(self, key: bytes) -> bool:
        for server in self._ranks([key])[0][: self._chain]:
            node = self._nodes[server]
            if self._call(node, lambda c: c.exists(key)):
                return True
            if not node.full:
                return False
        return False

    def _close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.shutdown(wait=True)
        for node in self._nodes:
            client, node.client = node.client, None
            node.configured = False
            if client is not None:
                client.close()

    # -- health and stats --------------------------------------------------------------------------
    def check(self) -> dict[str, str]:
        """Ping every server now (ignoring backoff); raise ``ClusterCacheError`` naming the failures."""
        problems = {}
        for node in self._nodes:
            node.down_until = 0.0
            if self._call(node, lambda c: c.ping()) is None and node.last_error:
                problems[node.url] = node.last_error
        if problems:
            detail = "; ".join(f"{url}: {why}" for url, why in problems.items())
            raise ClusterCacheError(f"{len(problems)} of {len(self._nodes)} cache servers unusable: {detail}")
        return {node.url: "ok" for node in self._nodes}

    def _tier_stats(self) -> dict[str, Any]:
        servers: dict[str, Any] = {}
        evictions = 0
        now = time.monotonic()
        for node in self._nodes:
            info = self._call(node, server_info) if node.down_until <= now else None
            entry: dict[str, Any] = dict(node.counts)
            lookups = entry["hits"] + entry["misses"]
            entry["hit_rate"] = entry["hits"] / lookups if lookups else 0.0  # this client's lookups
            down = node.down_until > time.monotonic()
            entry["state"] = "down" if down else ("full" if node.full else "up")
            entry["last_error"] = node.last_error
            if info is not None:
                entry.update(info)
                evictions += info.get("evicted_keys", 0)
            servers[node.url] = entry
        return {
            "servers": servers,
            "evictions": evictions,  # keys the servers evicted (server-wide counters)
            "capacity_bytes": self.capacity_bytes,
            "policy": self.policy.name,
            "down": [url for url, s in servers.items() if s["state"] == "down"],
        }


def _chunks(positions: list[int], items: Sequence[tuple[bytes, bytes]]) -> list[list[int]]:
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for pos in positions:
        cur.append(pos)
        size += len(items[pos][1])
        if size >= _MAX_PUT_BYTES:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out
