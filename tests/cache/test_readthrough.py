"""read_through: cache first, one batched storage read for the misses, then fill."""

from __future__ import annotations

import pytest

from stallfree.cache.base import CacheKey
from stallfree.cache.memory import MemoryCache
from stallfree.cache.readthrough import ReadStats, read_through

from .conftest import CountingDataset, make_samples


class Batched(CountingDataset):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[list[int]] = []

    def get_many(self, indices):
        self.calls.append(list(indices))
        return super().get_many(indices)


def test_order_hits_and_one_batched_read_for_misses():
    ds = Batched(make_samples(20))
    cache = MemoryCache()
    stats = ReadStats()
    assert [s["__key__"] for s in read_through(ds, [3, 1, 2], cache, stats=stats)] == [
        "s000003",
        "s000001",
        "s000002",
    ]
    out = read_through(ds, [5, 1, 7, 3], cache, stats=stats)
    assert out == [ds.samples[i] for i in (5, 1, 7, 3)]
    assert ds.calls == [[3, 1, 2], [5, 7]]
    assert stats.as_dict() == {"samples": 7, "cache_hits": 2, "storage_reads": 5, "hit_rate": 2 / 7}
    assert cache.get_many([CacheKey("ds0", 7, "raw")]) == [ds.samples[7]]


def test_stage_and_fingerprint_override():
    ds = CountingDataset(make_samples(4))
    cache = MemoryCache()
    read_through(ds, [0], cache, stage="decoded", fingerprint="other")
    assert cache.contains(CacheKey("other", 0, "decoded"))
    assert not cache.contains(CacheKey("ds0", 0, "raw"))


def test_dataset_without_get_many_and_without_cache():
    class Plain:
        fingerprint = "p"

        def __getitem__(self, i):
            return {"__key__": str(i)}

    assert read_through(Plain(), [2, 0], MemoryCache()) == [{"__key__": "2"}, {"__key__": "0"}]
    stats = ReadStats()
    assert read_through(Plain(), [1], None, stats=stats) == [{"__key__": "1"}]
    assert stats.storage_reads == 1


def test_missing_fingerprint_is_a_clear_error():
    with pytest.raises(TypeError, match="has no 'fingerprint' string; caching needs a stable content id"):
        read_through([{"__key__": "a"}], [0], MemoryCache())


def test_storage_errors_propagate_and_nothing_is_cached():
    ds = CountingDataset(make_samples(3))
    cache = MemoryCache()
    with pytest.raises(IndexError):
        read_through(ds, [0, 9], cache)
    assert cache.stats()["admitted"] == 0
