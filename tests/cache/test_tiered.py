"""TieredCache faults: a broken tier is a miss for that tier only, never for the whole chain."""

from __future__ import annotations

from stallfree.cache import codec
from stallfree.cache.base import CacheKey
from stallfree.cache.memory import MemoryCache
from stallfree.cache.node import NodeCache
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


def test_corrupt_entry_in_a_lower_tier_is_a_miss_and_dropped_from_every_tier(tmp_path, caplog):
    upper, lower = MemoryCache(), NodeCache(tmp_path / "node")
    key = CacheKey("fp", 3, "raw")
    good = codec.encode({"__key__": "k3", "jpg": b"\xff\xd8" * 100})
    lower.put_encoded_many([(key.to_bytes(), good[:-5] + b"\x00" * 5)])  # torn tail
    cache = TieredCache([upper, lower])
    with caplog.at_level("WARNING"):
        assert cache.get_many([key]) == [None]
    assert "corrupt" in caplog.text
    assert cache.stats()["corrupt"] == 1
    assert not upper.contains(key) and not lower.contains(key)  # promoted copy dropped too
    cache.put_many([(key, {"__key__": "k3", "jpg": b"ok"})])
    assert cache.get_many([key]) == [{"__key__": "k3", "jpg": b"ok"}]
    cache.close()
