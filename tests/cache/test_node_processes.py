"""NodeCache across processes: concurrent writers and readers, restarts, crashed writers."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np

from stallfree.cache.base import CacheKey
from stallfree.cache.node import NodeCache
from tests.cache.helpers import stored

N_PROCS = 4
PER_PROC = 40


def value(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "__key__": f"s{i}",
        "jpg": rng.bytes(int(rng.integers(100, 5000))),
        "arr": rng.standard_normal(i % 7 + 1),
    }


def same(a: dict, b: dict) -> bool:
    return a["__key__"] == b["__key__"] and a["jpg"] == b["jpg"] and np.array_equal(a["arr"], b["arr"])


def _worker(cache: NodeCache, rank: int, conn) -> None:
    """Write my share in small batches while reading everyone's; report what I saw."""
    mine = range(rank * PER_PROC, (rank + 1) * PER_PROC)
    total = N_PROCS * PER_PROC
    keys = [CacheKey("fp", i, "raw") for i in range(total)]
    bad = 0
    seen: set[int] = set()
    for start in range(mine.start, mine.stop, 5):
        cache.put_many([(keys[i], value(i)) for i in range(start, start + 5)])
        for i, got in enumerate(cache.get_many(keys)):
            if got is not None:
                seen.add(i)
                bad += not same(got, value(i))
    # keep reading until every other process has finished writing; a deadline, not a count of
    # reads, so a writer descheduled on a loaded machine still gets its time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = cache.get_many(keys)
        for i, g in enumerate(got):
            if g is not None:
                seen.add(i)
                bad += not same(g, value(i))
        if all(g is not None for g in got):
            break
    conn.send((len(seen), bad, cache.stats()["errors"]))
    conn.close()


def test_many_processes_write_and_read_one_node_cache(tmp_path):
    cache = NodeCache(tmp_path / "node", capacity_bytes=64 << 20)
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for rank in range(N_PROCS):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(cache, rank, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    results = [p.recv() for p in pipes]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert results == [(N_PROCS * PER_PROC, 0, 0)] * N_PROCS
    # a fresh object (as a restarted worker would have) sees all of it, byte for byte
    fresh = NodeCache(tmp_path / "node", capacity_bytes=64 << 20)
    keys = [CacheKey("fp", i, "raw") for i in range(N_PROCS * PER_PROC)]
    got = fresh.get_many(keys)
    assert all(same(g, value(i)) for i, g in enumerate(got))
    stats = fresh.stats()
    assert stats["entries"] == N_PROCS * PER_PROC
    assert stats["used_bytes"] == sum(
        len(stored(CacheKey("fp", i, "raw"), value(i))) for i in range(N_PROCS * PER_PROC)
    )


def test_capacity_is_shared_by_processes(tmp_path):
    """Two processes filling one minio NodeCache never exceed its one budget together."""
    sizes = {i: len(stored(CacheKey("fp", i, "raw"), value(i))) for i in range(200)}
    capacity = sum(sizes[i] for i in range(60))
    cache = NodeCache(tmp_path / "node", capacity_bytes=capacity)
    ctx = mp.get_context("fork")

    def fill(lo: int, hi: int) -> None:
        for start in range(lo, hi, 10):
            cache.put_many([(CacheKey("fp", i, "raw"), value(i)) for i in range(start, start + 10)])

    procs = [ctx.Process(target=fill, args=(0, 100)), ctx.Process(target=fill, args=(100, 200))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    got = cache.get_many([CacheKey("fp", i, "raw") for i in range(200)])
    held = [i for i, g in enumerate(got) if g is not None]
    assert sum(sizes[i] for i in held) <= capacity
    assert cache.stats()["used_bytes"] == sum(sizes[i] for i in held)
    assert sum(sizes[i] for i in held) > capacity - 2 * max(sizes.values())


def _crashing_writer(path: str, conn) -> None:
    cache = NodeCache(path, capacity_bytes=256 << 20)
    i = 0
    while True:  # big batches so the kill lands mid-transaction
        cache.put_many(
            [(CacheKey("fp", j, "raw"), {"x": bytes([j % 251]) * 200_000}) for j in range(i, i + 20)]
        )
        i += 20
        conn.send(i)


def test_crashed_writer_leaves_no_corrupt_entry(tmp_path):
    path = str(tmp_path / "node")
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_crashing_writer, args=(path, child))
    proc.start()
    committed = 0
    while committed < 100:
        committed = parent.recv()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    cache = NodeCache(path, capacity_bytes=256 << 20)
    keys = [CacheKey("fp", j, "raw") for j in range(committed + 100)]
    got = cache.get_many(keys)
    present = [j for j, g in enumerate(got) if g is not None]
    assert set(range(committed)) <= set(present)  # every acknowledged batch survived
    assert present == list(range(len(present)))  # whole batches only: no partial transaction
    assert len(present) % 20 == 0
    assert all(got[j] == {"x": bytes([j % 251]) * 200_000} for j in present)
    assert cache.stats()["corrupt"] == 0
    # and the store is writable again
    cache.put_many([(CacheKey("fp", 10**6, "raw"), b"after crash")])
    assert cache.get_many([CacheKey("fp", 10**6, "raw")]) == [b"after crash"]


def _reader_that_dies(path: str, conn) -> None:
    from stallfree.cache import lmdbenv

    cache = NodeCache(path)
    cache.get_many([CacheKey("fp", 0, "raw")])
    with lmdbenv.using():  # hold a read transaction open, then get killed
        txn = lmdbenv.acquire(path, cache.map_size).env.begin()
        conn.send(txn.id())
        time.sleep(60)


def test_killed_worker_leaves_no_stale_reader(tmp_path):
    path = str(tmp_path / "node")
    NodeCache(path).put_many([(CacheKey("fp", 0, "raw"), b"x")])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_reader_that_dies, args=(path, child))
    proc.start()
    assert parent.poll(30), "reader process did not start"
    parent.recv()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    # a restarted worker (a fresh process) opens the store: stale reader slots are cleared
    parent2, child2 = ctx.Pipe(duplex=False)
    fresh = ctx.Process(target=_restarted_worker, args=(path, child2))
    fresh.start()
    assert parent2.poll(30), "restarted worker did not report"
    got, readers = parent2.recv()
    fresh.join(10)
    assert got == [b"x", b"y"]
    assert f" {proc.pid} " not in readers


def _restarted_worker(path: str, conn) -> None:
    from stallfree.cache import lmdbenv

    cache = NodeCache(path)
    cache.put_many([(CacheKey("fp", 1, "raw"), b"y")])
    got = cache.get_many([CacheKey("fp", 0, "raw"), CacheKey("fp", 1, "raw")])
    with lmdbenv.using():
        readers = lmdbenv.acquire(path, cache.map_size).env.readers()
    conn.send((got, readers))
