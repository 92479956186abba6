"""``read_through`` is the one cached-read path for raw and decoded stages alike: the loader's
stage cache passes its read-and-decode as ``fetch``; failed samples come back in place and are
never stored; a cache object that raises is a miss, never an error."""

from __future__ import annotations

from stallfree.cache.base import CacheKey
from stallfree.cache.memory import MemoryCache
from stallfree.cache.readthrough import ReadStats, read_through


class Store:
    fingerprint = "fp-stage"

    def __init__(self) -> None:
        self.reads: list[list[int]] = []

    def get_many(self, indices):
        self.reads.append(list(indices))
        return [{"__key__": f"k{i}", "v": str(i).encode()} for i in indices]


def test_a_decoded_stage_reads_and_decodes_only_its_misses():
    cache, calls = MemoryCache(), []

    def decode(missing):
        calls.append(list(missing))
        return [{"__key__": f"k{i}", "n": i * 10} for i in missing]

    first = read_through(Store(), [3, 1, 2], cache, "decoded", fetch=decode)
    assert [s["n"] for s in first] == [30, 10, 20] and calls == [[3, 1, 2]]
    stats = ReadStats()
    again = read_through(Store(), [2, 4, 3], cache, "decoded", fetch=decode, stats=stats)
    assert [s["n"] for s in again] == [20, 40, 30] and calls == [[3, 1, 2], [4]]
    assert (stats.samples, stats.cache_hits, stats.storage_reads) == (3, 2, 1)
    assert cache.contains(CacheKey("fp-stage", 4, "decoded"))
    assert not cache.contains(CacheKey("fp-stage", 4, "raw"))  # stages are separate entries


def test_a_failed_sample_is_returned_in_place_and_never_cached():
    cache = MemoryCache()
    bad = ValueError("sample 1 does not decode")

    def decode(missing):
        return [bad if i == 1 else {"__key__": f"k{i}", "n": i} for i in missing]

    got = read_through(Store(), [0, 1, 2], cache, "decoded", fetch=decode)
    assert got[1] is bad and [got[0]["n"], got[2]["n"]] == [0, 2]
    assert [cache.contains(CacheKey("fp-stage", i, "decoded")) for i in range(3)] == [True, False, True]


class Broken:
    """A cache object (not a BaseCache) that raises on every call."""

    def get_many(self, keys, check=None):
        raise ConnectionError("tier down")

    def put_many(self, items):
        raise ConnectionError("tier down")


def test_a_cache_that_raises_is_a_miss(caplog):
    store = Store()
    got = read_through(store, [5, 6], Broken())
    assert [s["__key__"] for s in got] == ["k5", "k6"] and store.reads == [[5, 6]]
    assert "cache lookup of 2 entries failed" in caplog.text
    assert "could not cache 2 samples" in caplog.text
