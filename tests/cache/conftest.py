"""Fixtures for the cache tests: real redis-server processes on loopback ports, datasets whose
storage reads are counted, and a factory for every cache tier (the shared conformance suite)."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from stallfree.cache.cluster import ClusterCache
from stallfree.cache.memory import MemoryCache
from stallfree.cache.node import NodeCache
from stallfree.cache.server import RedisServer
from stallfree.cache.tiered import TieredCache

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


@pytest.fixture
def redis_servers(tmp_path):
    """``start(n, **kw) -> list[RedisServer]``: n real servers (no persistence), killed afterwards."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    started: list[RedisServer] = []

    def start(n: int = 1, **kwargs) -> list[RedisServer]:
        servers = []
        for _ in range(n):
            server = RedisServer(workdir=tmp_path / f"redis-{len(started)}", **kwargs)
            started.append(server)
            servers.append(server.start())
        return servers

    yield start
    for server in started:
        server.cleanup()


class CountingDataset:
    """A map-style dataset with a fingerprint whose every storage read is counted."""

    def __init__(self, samples: list[dict], fingerprint: str = "ds0") -> None:
        self.samples = samples
        self.fingerprint = fingerprint
        self.reads = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self.samples):
            raise IndexError(i)
        with self._lock:
            self.reads += 1
        return dict(self.samples[i])

    def get_many(self, indices):
        return [self[i] for i in indices]


def make_samples(n: int, size: int = 1000, seed: int = 0) -> list[dict]:
    """``n`` samples of equal encoded size: random payload bytes, a label, a key."""
    rng = np.random.default_rng(seed)
    return [{"__key__": f"s{i:06d}", "jpg": rng.bytes(size), "cls": int(i % 10)} for i in range(n)]


@pytest.fixture
def counting_dataset():
    def make(n: int, size: int = 1000, seed: int = 0, fingerprint: str = "ds0") -> CountingDataset:
        return CountingDataset(make_samples(n, size, seed), fingerprint)

    return make


TIERS = ["memory", "node", "cluster", "tiered"]


@pytest.fixture(params=TIERS)
def make_cache(request, tmp_path, redis_servers_lazy):
    """``make(capacity_bytes=None, policy="minio") -> cache`` for each tier.

    ``capacity_bytes`` is the total the tier may hold (a 3-server cluster gets a third per server).
    The factory carries ``.tier``, ``.shared`` (a pickled copy sees the same entries) and
    ``.exact_lru`` (Redis' LRU is approximate, with one-second clock resolution).
    """
    tier = request.param
    made = []
    counter = iter(range(1000))

    def make(capacity_bytes=None, policy="minio"):
        n = next(counter)
        if tier == "memory":
            cache = MemoryCache(capacity_bytes, policy)
        elif tier == "node":
            cache = NodeCache(tmp_path / f"node-{n}", capacity_bytes, policy)
        elif tier == "cluster":
            servers = redis_servers_lazy(3)
            per = None if capacity_bytes is None else capacity_bytes // 3
            cache = ClusterCache([s.url for s in servers], per, policy, backoff_s=0.05)
        else:
            cache = TieredCache(
                [
                    MemoryCache(capacity_bytes, policy),
                    NodeCache(tmp_path / f"tier-{n}", capacity_bytes, policy),
                ]
            )
        made.append(cache)
        return cache

    make.tier = tier
    make.shared = tier in ("node", "cluster")
    make.exact_lru = tier != "cluster"
    # Redis counts its own overhead (buffers, scripts) against maxmemory: test it with bigger entries
    make.item_size = 40_000 if tier == "cluster" else 1000
    yield make
    for cache in made:
        cache.close()


@pytest.fixture
def redis_servers_lazy(request):
    """Like ``redis_servers`` but only started (fresh) when a test asks for them."""

    def start(n: int):
        # unrestricted (plain requirepass) servers: the conformance suite lets the client apply
        # each tier's policy, as it does on a Redis a user runs themselves
        return request.getfixturevalue("redis_servers")(n, restricted=False)

    return start
