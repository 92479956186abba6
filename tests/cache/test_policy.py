"""Admission policies under epoch-random access (CoorDL's setting): minio vs lru at 50% capacity."""

from __future__ import annotations

import numpy as np
import pytest

from stallfree.cache.base import CacheKey
from stallfree.cache.cluster import ClusterCache
from stallfree.cache.memory import MemoryCache
from stallfree.cache.node import NodeCache
from stallfree.cache.policy import LRU, MINIO, get_policy
from tests.cache.helpers import stored

N = 400
EPOCHS = 4


def hit_rate(cache, samples) -> float:
    """Epoch 1 fills; the hit rate over epochs 2..EPOCHS, each a fresh random permutation."""
    keys = [CacheKey("fp", i, "raw") for i in range(len(samples))]
    hits = lookups = 0
    for epoch in range(EPOCHS):
        order = np.random.default_rng(epoch).permutation(len(samples))
        for start in range(0, len(order), 8):
            batch = order[start : start + 8]
            got = cache.get_many([keys[i] for i in batch])
            cache.put_many([(keys[i], samples[i]) for i, g in zip(batch, got, strict=True) if g is None])
            if epoch:
                hits += sum(g is not None for g in got)
                lookups += len(batch)
    return hits / lookups


def equal_samples(size: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"__key__": f"s{i:05d}", "jpg": rng.bytes(size)} for i in range(N)]


@pytest.mark.parametrize("tier", ["memory", "node", "cluster"])
def test_minio_hits_the_cached_fraction_lru_less(tier, tmp_path, redis_servers):
    size = 20_000 if tier == "cluster" else 1000
    samples = equal_samples(size)
    half = sum(len(stored(CacheKey("fp", i, "raw"), s)) for i, s in enumerate(samples)) // 2
    rates = {}
    for policy in ("minio", "lru"):
        if tier == "memory":
            cache = MemoryCache(half, policy)
        elif tier == "node":
            cache = NodeCache(tmp_path / policy, half, policy)
        else:
            servers = redis_servers(3, restricted=False)  # the client applies each policy
            cache = ClusterCache([s.url for s in servers], half // 3, policy)
        rates[policy] = hit_rate(cache, samples)
        cache.close()
    print(
        f"\n{tier}: hit rate at 50% capacity, epochs 2-{EPOCHS}: minio {rates['minio']:.3f}, lru {rates['lru']:.3f}"
    )
    assert abs(rates["minio"] - 0.5) <= 0.02
    assert rates["lru"] < rates["minio"] - 0.02


def test_policy_names():
    assert get_policy("minio") is MINIO and get_policy("LRU") is LRU and get_policy(LRU) is LRU
    assert MINIO.redis_maxmemory_policy == "noeviction" and LRU.redis_maxmemory_policy == "allkeys-lru"
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'; choose one of"):
        get_policy("fifo")
    assert MINIO.admits(90, 10, 100) and not MINIO.admits(91, 10, 100)
    assert LRU.admits(100, 10, 100) and not LRU.admits(0, 101, 100)


def test_room_needed():
    assert LRU.room_needed(95, 10, 100) == 5 and LRU.room_needed(90, 10, 100) == 0
    assert LRU.room_needed(50, 101, 100) == 0  # never fits: nothing is evicted for it
    assert LRU.room_needed(95, 10, None) == 0
    assert MINIO.room_needed(95, 10, 100) == 0  # minio never evicts
