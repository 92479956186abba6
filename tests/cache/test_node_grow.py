"""NodeCache objects of different capacities sharing one LMDB environment: the map grows safely."""

from __future__ import annotations

import multiprocessing as mp
import threading

from stallfree.cache import lmdbenv
from stallfree.cache.base import CacheKey
from stallfree.cache.node import NodeCache
from tests.cache.helpers import stored

SMALL_MAP = 1 << 20


def key(i: int) -> CacheKey:
    return CacheKey("fp", i, "raw")


def value(i: int, size: int = 2000) -> bytes:
    return bytes([i % 251]) * size


def small_cache(path: str, n: int = 50) -> NodeCache:
    """A NodeCache whose environment opens with a 1 MiB map, holding keys 0..n-1."""
    cache = NodeCache(path, capacity_bytes=SMALL_MAP // 4)
    cache.map_size = SMALL_MAP  # before first use: the shared environment opens with it
    cache.put_many([(key(i), value(i)) for i in range(n)])
    assert cache.stats()["map_size"] == SMALL_MAP
    return cache


def test_grow_waits_for_a_transaction_open_in_another_thread(tmp_path):
    path = str(tmp_path / "node")
    small = small_cache(path)
    opened, asked = threading.Event(), threading.Event()
    result: dict = {}

    def reader() -> None:
        try:
            with lmdbenv.using():
                handle = lmdbenv.acquire(path, small.map_size)
                with handle.env.begin(db=handle.dbs[0]) as txn:  # the data table
                    opened.set()
                    asked.wait(30)
                    result["values"] = [txn.get(key(i).to_bytes()) for i in range(50)]
        except Exception as exc:  # before the fix: the grow invalidated this open transaction
            result["error"] = exc

    thread = threading.Thread(target=reader)
    thread.start()
    assert opened.wait(30)
    big = NodeCache(path, capacity_bytes=8 << 20)
    big.put_many([(key(1000), b"first")])  # asks for a larger map while the reader's transaction is open
    asked.set()
    thread.join(30)
    assert "error" not in result, result.get("error")
    assert result["values"] == [stored(key(i), value(i)) for i in range(50)]
    # the grow happened once the reader was done: entries that never fitted the old map now do
    assert big.stats()["map_size"] >= big.map_size > SMALL_MAP
    assert small.stats()["map_size"] == big.stats()["map_size"]  # one environment per process
    big.put_many([(key(2000 + i), value(i, 100_000)) for i in range(20)])  # 2 MB
    assert big.stats()["admitted"] == 21
    assert big.get_many([key(1000), key(2019)]) == [b"first", value(19, 100_000)]
    assert small.get_many([key(i) for i in range(50)]) == [value(i) for i in range(50)]
    assert small.stats()["errors"] == big.stats()["errors"] == 0
    small.close()
    big.close()


def test_two_capacities_from_two_threads_with_concurrent_reads(tmp_path):
    path = str(tmp_path / "node")
    small = small_cache(path)
    stop = threading.Event()
    report = {"reads": 0, "wrong": 0}

    def read_small() -> None:
        while not stop.is_set():
            got = small.get_many([key(i) for i in range(50)])
            report["reads"] += 1
            report["wrong"] += sum(g != value(i) for i, g in enumerate(got))

    readers = [threading.Thread(target=read_small) for _ in range(2)]
    for t in readers:
        t.start()
    bigs = []
    try:
        for step in range(8):  # each new cache asks for a larger map while the readers run
            big = NodeCache(path, capacity_bytes=(4 << 20) * (step + 1))
            bigs.append(big)
            batch = [(key(10_000 + 100 * step + j), value(step + j, 50_000)) for j in range(10)]
            big.put_many(batch)
            big.put_many(batch)  # stored by now: the first write may still have run on the old map
            assert big.get_many([k for k, _ in batch]) == [v for _, v in batch]
    finally:
        stop.set()
        for t in readers:
            t.join(30)
    assert report["reads"] > 0 and report["wrong"] == 0
    assert small.stats()["errors"] == 0
    assert all(b.stats()["errors"] == 0 for b in bigs)
    assert small.stats()["map_size"] >= bigs[-1].map_size
    assert small.get_many([key(i) for i in range(50)]) == [value(i) for i in range(50)]
    for cache in (small, *bigs):
        cache.close()


def _grow_in_another_process(path: str) -> None:
    big = NodeCache(path, capacity_bytes=64 << 20)
    big.put_many([(key(1000 + i), value(i, 100_000)) for i in range(30)])  # 3 MB: beyond the 1 MiB map


def test_store_grown_by_another_process_is_adopted(tmp_path):
    path = str(tmp_path / "node")
    small = small_cache(path)
    proc = mp.get_context("spawn").Process(target=_grow_in_another_process, args=(path,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    # this process's map is now smaller than the store: LMDB answers MDB_MAP_RESIZED until it adopts
    wanted = [key(i) for i in range(50)] + [key(1000 + i) for i in range(30)]
    expected = [value(i) for i in range(50)] + [value(i, 100_000) for i in range(30)]
    assert small.get_many(wanted) == expected
    stats = small.stats()
    assert (stats["hits"], stats["misses"], stats["errors"]) == (80, 0, 0)
    assert stats["map_size"] >= NodeCache(path, capacity_bytes=64 << 20).map_size
    small.close()


def test_grow_asked_inside_an_operation_waits_for_its_end(tmp_path):
    """Nested use in one thread (an outer ``using()`` held open) runs on the old map and never waits
    for itself; the grow happens when the outermost operation ends."""
    path = str(tmp_path / "node")
    small = small_cache(path)
    with lmdbenv.using():
        handle = lmdbenv.acquire(path, small.map_size)
        big = NodeCache(path, capacity_bytes=8 << 20)
        big.put_many([(key(1000), b"inside")])
        assert small.get_many([key(0)]) == [value(0)]
        assert handle.env.info()["map_size"] == SMALL_MAP  # still the old map: an operation is running
    assert big.stats()["map_size"] >= big.map_size
    assert big.get_many([key(1000)]) == [b"inside"]
    assert small.stats()["errors"] == big.stats()["errors"] == 0
    small.close()
    big.close()
