"""TieredCache faults: a broken tier is a miss for that tier only, never for the whole chain."""

from __future__ import annotations

from stallfree.cache.base import CacheKey
from stallfree.cache.memory import MemoryCache
from stallfree.cache.tiered import TieredCache


class BrokenCache(MemoryCache):
    """A tier whose every lookup fails, as a dead server's would."""

    def _contains_raw(self, key: bytes) -> bool:
        raise ConnectionError("tier is down")

    def _get_raw(self, keys):
        raise ConnectionError("tier is down")


def test_contains_finds_a_key_behind_a_broken_tier():
    broken, memory = BrokenCache(), MemoryCache()
    key = CacheKey("fp", 7, "raw")
    memory.put_many([(key, {"__key__": "k7", "jpg": b"\xff\xd8data"})])
    cache = TieredCache([broken, memory])
    assert cache.contains(key) is True
    assert cache.contains(CacheKey("fp", 8, "raw")) is False
    assert broken.stats()["errors"] == 2
    got = cache.get_many([key])
    assert got[0]["jpg"] == b"\xff\xd8data"
