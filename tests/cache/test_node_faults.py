"""NodeCache when a write fails mid-batch: LRU recency and the counters survive the failure."""

from __future__ import annotations

import lmdb
import pytest

from stallfree.cache import lmdbenv
from stallfree.cache.base import CacheKey
from stallfree.cache.node import NodeCache
from tests.cache.helpers import stored

ITEM = 1000
N = 10


def key(i: int) -> CacheKey:
    return CacheKey("fp", i, "raw")


def value(i: int) -> bytes:
    return bytes([i % 251]) * ITEM


def lru_cache(path, map_size: int | None = None) -> NodeCache:
    """An LRU NodeCache that holds exactly ``N`` entries, filled with keys 0..N-1 (0 the oldest)."""
    cache = NodeCache(path, capacity_bytes=N * len(stored(key(0), value(0))), policy="lru")
    if map_size is not None:
        cache.map_size = map_size  # before first use: the environment opens with it
    for i in range(N):
        cache.put_many([(key(i), value(i))])
    return cache


def kept(cache: NodeCache, n: int) -> set[int]:
    """Which of keys 0..n-1 are stored (``contains`` does not count as a use)."""
    return {i for i in range(n) if cache.contains(key(i))}


def fill_map(path: str, map_size: int) -> list[bytes]:
    """Fill the environment's unused map space with filler records in LMDB's main table (outside
    the cache's tables and byte budget) until a write no longer fits; returns their keys."""
    names = []
    with lmdbenv.using():
        env = lmdbenv.acquire(path, map_size).env
        for size in (1 << 16, 1 << 12, 1 << 9, 1 << 6):
            while True:
                name = b"~filler-%d" % len(names)
                try:
                    with env.begin(write=True) as txn:
                        txn.put(name, b"f" * size)
                except lmdb.MapFullError:
                    break
                names.append(name)
    return names


def free_map(path: str, map_size: int, names: list[bytes]) -> None:
    """Delete the filler in two transactions: LMDB reuses the pages a transaction freed only from
    the second write transaction after it (the last committed snapshot stays intact)."""
    with lmdbenv.using():
        env = lmdbenv.acquire(path, map_size).env
        for part in (names[::2], names[1::2]):
            with env.begin(write=True) as txn:
                for name in part:
                    txn.delete(name)


def test_lru_touches_survive_a_full_map(tmp_path):
    path = str(tmp_path / "node")
    map_size = 1 << 20
    cache = lru_cache(path, map_size)
    assert cache.get_many([key(0), key(1), key(2)]) == [value(0), value(1), value(2)]  # now most recent
    filler = fill_map(path, map_size)
    before = cache.stats()
    cache.put_many([(key(100), value(100))])  # the write transaction fails: LMDB map full
    after = cache.stats()
    assert after["rejected"] == before["rejected"] + 1  # the failure path really ran
    assert after["admitted"] == before["admitted"]
    free_map(path, map_size, filler)
    # seven new entries make seven evictions: the seven least recently used go, not the three just read
    for i in range(N, N + 7):
        cache.put_many([(key(i), value(i))])
    assert kept(cache, N + 7) == {0, 1, 2, *range(N, N + 7)}
    assert cache.stats()["errors"] == 0
    cache.close()


def test_lru_touches_survive_a_failed_write(tmp_path):
    cache = lru_cache(tmp_path / "node")
    assert cache.get_many([key(0), key(1), key(2)]) == [value(0), value(1), value(2)]
    before = cache.stats()["errors"]
    cache.put_encoded_many([(b"", b"x")])  # LMDB refuses an empty key inside the write transaction
    assert cache.stats()["errors"] == before + 1
    for i in range(N, N + 7):
        cache.put_many([(key(i), value(i))])
    assert kept(cache, N + 7) == {0, 1, 2, *range(N, N + 7)}
    cache.close()


@pytest.mark.parametrize("reads", [1, 3])
def test_touches_kept_across_repeated_failures(tmp_path, reads):
    """Failed writes one after another keep every pending touch, in the order the reads happened."""
    cache = lru_cache(tmp_path / "node")
    for _ in range(reads):
        cache.get_many([key(5)])
        cache.put_encoded_many([(b"", b"x")])
    cache.get_many([key(0)])
    cache.put_encoded_many([(b"", b"x")])
    # key 5 then key 0 are the most recent; eight new entries evict the other eight
    for i in range(N, N + 8):
        cache.put_many([(key(i), value(i))])
    assert kept(cache, N + 8) == {5, 0, *range(N, N + 8)}
    cache.put_many([(key(N + 8), value(N + 8))])  # one more evicts key 5 (older than key 0)
    assert kept(cache, N + 9) == {0, *range(N, N + 9)}
    cache.close()


def test_full_map_rejects_only_new_entries(tmp_path):
    path = str(tmp_path / "node")
    map_size = 1 << 20
    cache = lru_cache(path, map_size)
    fill_map(path, map_size)
    before = cache.stats()
    cache.put_many(
        [(key(3), value(3)), (key(100), value(100)), (key(101), value(101)), (key(100), value(100))]
    )
    after = cache.stats()
    # key 3 is already stored (neither admitted nor rejected); 100 and 101 are turned away once each
    assert after["rejected"] - before["rejected"] == 2
    assert after["admitted"] == before["admitted"]
    assert after["errors"] == 0
    cache.close()


class StampFailsCache(NodeCache):
    """Injects a failure into the LRU bookkeeping of a write transaction while ``fail`` is set."""

    fail = False

    def _stamp(self, *args, **kwargs):
        if self.fail:
            raise lmdb.DiskError("injected failure while recording recency")
        return NodeCache._stamp(*args, **kwargs)


def test_failed_recency_flush_on_read_keeps_hits_and_touches(tmp_path, monkeypatch):
    from stallfree.cache import node

    cache = StampFailsCache(tmp_path / "node", capacity_bytes=N * len(stored(key(0), value(0))), policy="lru")
    for i in range(N):
        cache.put_many([(key(i), value(i))])
    monkeypatch.setattr(node, "_MAX_TOUCHED", 2)  # the third pending touch makes the read flush them
    cache.fail = True
    before = cache.stats()
    assert cache.get_many([key(0), key(1), key(2)]) == [value(0), value(1), value(2)]
    after = cache.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (3, 0)
    assert after["errors"] - before["errors"] == 1  # the failed flush, counted once
    cache.fail = False
    for i in range(N, N + 7):
        cache.put_many([(key(i), value(i))])
    # the pending touches were kept, bounded to the most recent _MAX_TOUCHED (keys 1 and 2): the seven
    # least recently used are 0 and 3..8
    assert kept(cache, N + 7) == {1, 2, 9, *range(N, N + 7)}
    cache.close()


@pytest.mark.parametrize("damage", ["garbage data.mdb", "a file at the path"])
def test_a_store_that_is_not_lmdb_is_misses_not_exceptions(tmp_path, damage, caplog):
    path = tmp_path / "store"
    if damage == "garbage data.mdb":
        path.mkdir()
        (path / "data.mdb").write_bytes(b"\x5a" * 100_000)
        why = "MDB_INVALID"
    else:
        path.write_bytes(b"not a directory")
        why = "FileExistsError"
    cache = NodeCache(path, capacity_bytes=1 << 20)
    with caplog.at_level("WARNING"):
        assert cache.get_many([key(1), key(2)]) == [None, None]
        cache.put_many([(key(1), value(1))])
        assert not cache.contains(key(1))
    assert why in caplog.text
    stats = cache.stats()
    assert stats["misses"] == 2 and stats["hits"] == 0 and stats["admitted"] == 0
    assert stats["errors"] >= 3  # get, put, contains: each counted, none raised
    cache.close()
