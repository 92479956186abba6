"""ClusterCache on 3 real redis-server processes playing 3 nodes of a data-parallel job."""

from __future__ import annotations

import math
import os
import pickle
import signal
import sys
import time

import numpy as np
import pytest

from stallfree.cache.base import CacheKey
from stallfree.cache.cluster import ClusterCache, ClusterCacheError, rendezvous_rank, server_status
from stallfree.cache.node import NodeCache
from stallfree.cache.readthrough import ReadStats, read_through
from stallfree.cache.server import RedisServer, free_port
from tests.cache.helpers import stored

N = 300
RANKS = 3
BATCH = 16


def run_epoch(ds, caches, epoch: int, *, on_batch=None) -> tuple[list[str], ReadStats]:
    """One epoch of a 3-rank job: a seeded permutation, rank r takes every 3rd index."""
    stats = ReadStats()
    order = np.random.default_rng([7, epoch]).permutation(len(ds))
    delivered: list[str] = []
    step = 0
    for rank in range(RANKS):
        mine = order[rank::RANKS]
        for start in range(0, len(mine), BATCH):
            if on_batch is not None:
                on_batch(step)
            samples = read_through(ds, mine[start : start + BATCH], caches[rank], stats=stats)
            delivered += [s["__key__"] for s in samples]
            step += 1
    return delivered, stats


def dataset_bytes(ds) -> tuple[int, int]:
    sizes = [len(stored(CacheKey(ds.fingerprint, i, "raw"), s)) for i, s in enumerate(ds.samples)]
    return sum(sizes), max(sizes)


def per_rank(cache):
    """Each rank's process holds its own (unpickled) copy, as DataLoader workers would."""
    return [pickle.loads(pickle.dumps(cache)) for _ in range(RANKS)]


def test_epoch2_reads_nothing_from_storage_when_the_cluster_fits(redis_servers, counting_dataset):
    servers = redis_servers(3)
    ds = counting_dataset(N)
    total, _ = dataset_bytes(ds)
    caches = per_rank(ClusterCache([s.url for s in servers], capacity_bytes=total, policy="minio"))
    keys1, s1 = run_epoch(ds, caches, 1)
    assert s1.storage_reads == N and ds.reads == N
    keys2, s2 = run_epoch(ds, caches, 2)
    assert s2.storage_reads == 0 and ds.reads == N
    assert sorted(keys1) == sorted(keys2) == sorted(s["__key__"] for s in ds.samples)
    # one owner per key: the servers hold the dataset once, about a third each
    stats = caches[0].stats()["servers"]
    held = [s["keys"] - 1 for s in stats.values()]  # minus the "used" counter
    assert sum(held) == N
    assert all(60 <= h <= 140 for h in held)


@pytest.mark.parametrize("sizes", ["equal", "varied"])
def test_minio_cluster_at_a_third_per_node_holds_the_dataset_node_local_does_not(
    redis_servers, counting_dataset, tmp_path, sizes
):
    servers = redis_servers(3)
    ds = counting_dataset(N)
    if sizes == "varied":  # 200 B .. 3 KB payloads
        rng = np.random.default_rng(5)
        for s in ds.samples:
            s["jpg"] = s["jpg"] * 3
            s["jpg"] = s["jpg"][: int(rng.integers(200, 3000))]
    total, biggest = dataset_bytes(ds)
    per_node = math.ceil(total / 3)  # exactly a third: spilling to the next-ranked server fills every node
    cluster = per_rank(ClusterCache([s.url for s in servers], capacity_bytes=per_node, policy="minio"))
    run_epoch(ds, cluster, 1)
    _, cluster2 = run_epoch(ds, cluster, 2)

    local = [NodeCache(tmp_path / f"node{r}", capacity_bytes=per_node, policy="minio") for r in range(RANKS)]
    run_epoch(ds, local, 1)
    _, local2 = run_epoch(ds, local, 2)

    print(
        f"\n{sizes} sizes, epoch-2 storage reads of {N}: cluster(minio, 1/3 per node) {cluster2.storage_reads}, "
        f"node-local(1/3 each) {local2.storage_reads}"
    )
    # equal sizes fit exactly; varied ones may leave less than one entry of room per server unused
    assert cluster2.storage_reads == 0 if sizes == "equal" else cluster2.storage_reads <= N // 50
    assert 0.55 <= local2.storage_reads / N <= 0.78  # ~2/3: each node caches only its own epoch-1 third
    for server in cluster[0].stats()["servers"].values():
        assert server["cached_bytes"] <= per_node


def test_killed_server_mid_epoch_then_restarted(redis_servers, counting_dataset):
    servers = redis_servers(3)
    ds = counting_dataset(N)
    total, _ = dataset_bytes(ds)
    base = ClusterCache([s.url for s in servers], capacity_bytes=total, backoff_s=0.05, max_backoff_s=0.2)
    caches = per_rank(base)
    run_epoch(ds, caches, 1)
    victim = servers[1]

    def kill_half_way(step: int) -> None:
        if step == 10:
            victim.kill()

    reads_before = ds.reads
    keys, stats = run_epoch(ds, caches, 2, on_batch=kill_half_way)
    assert sorted(keys) == sorted(s["__key__"] for s in ds.samples)  # every sample exactly once
    assert 0 < stats.storage_reads < N  # the dead node's share came from storage instead
    assert ds.reads - reads_before == stats.storage_reads
    merged = [c.stats() for c in caches]
    assert sum(m["errors"] for m in merged) >= 1
    assert any(m["servers"][victim.url]["state"] == "down" for m in merged)
    assert any("Connection" in m["servers"][victim.url]["last_error"] for m in merged)

    victim.start()  # same port, empty (no persistence)
    time.sleep(0.3)  # past the breaker's backoff
    run_epoch(ds, caches, 3)  # refills the restarted node
    _, stats4 = run_epoch(ds, caches, 4)
    assert stats4.storage_reads == 0
    status = caches[0].stats()["servers"][victim.url]
    assert status["state"] == "up" and status["last_error"] == ""
    assert status["keys"] > 1


def test_slow_server_times_out_to_misses_then_recovers(redis_servers):
    servers = redis_servers(3)
    cache = ClusterCache([s.url for s in servers], timeout_s=0.3, backoff_s=0.05, max_backoff_s=0.1)
    keys = [CacheKey("fp", i, "raw") for i in range(60)]
    cache.put_many([(k, f"v{k.index}".encode()) for k in keys])
    slow = servers[2]
    owned = [k for k in keys if rendezvous_rank(k.to_bytes(), cache._idents)[0] == 2]
    assert owned
    os.kill(slow.process.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = cache.get_many(keys)
        assert time.monotonic() - t0 < 5
        assert [k for k, g in zip(keys, got, strict=True) if g is None] == owned
        assert cache.stats()["servers"][slow.url]["state"] == "down"
        assert "Timeout" in cache.stats()["servers"][slow.url]["last_error"]
        assert cache.stats()["errors"] >= 1
    finally:
        os.kill(slow.process.pid, signal.SIGCONT)
    time.sleep(0.2)
    assert cache.get_many(keys) == [f"v{k.index}".encode() for k in keys]


def test_password(redis_servers):
    (server,) = redis_servers(1, password="s3cret pass")
    good = ClusterCache([server.url], password="s3cret pass")
    good.put_many([(CacheKey("fp", 1, "raw"), b"hello")])
    assert good.get_many([CacheKey("fp", 1, "raw")]) == [b"hello"]
    assert good.check() == {server.url: "ok"}
    # in the URL works too
    assert ClusterCache([server.url.replace("//", "//:s3cret%20pass@")]).get_many(
        [CacheKey("fp", 1, "raw")]
    ) == [b"hello"]
    for wrong in (ClusterCache([server.url], password="wrong"), ClusterCache([server.url])):
        assert wrong.get_many([CacheKey("fp", 1, "raw")]) == [None]  # a miss, never a crash
        wrong.put_many([(CacheKey("fp", 2, "raw"), b"x")])
        status = wrong.stats()["servers"][server.url]
        assert status["state"] == "down"
        assert "authentication failed" in status["last_error"]
        with pytest.raises(ClusterCacheError, match="authentication failed"):
            wrong.check()
    assert good.get_many([CacheKey("fp", 2, "raw")]) == [None]


def test_rendezvous_hashing_one_owner_and_minimal_movement():
    idents = [f"10.0.0.{i}:6379".encode() for i in range(3)]
    keys = [CacheKey("fp", i, "raw").to_bytes() for i in range(3000)]
    owners = [rendezvous_rank(k, idents)[0] for k in keys]
    assert owners == [rendezvous_rank(k, list(idents))[0] for k in keys]  # deterministic
    counts = np.bincount(owners, minlength=3)
    assert all(900 <= c <= 1100 for c in counts)
    grown = [rendezvous_rank(k, [*idents, b"10.0.0.3:6379"])[0] for k in keys]
    moved = sum(a != b for a, b in zip(owners, grown, strict=True))
    assert all(b == 3 for a, b in zip(owners, grown, strict=True) if a != b)  # only to the new node
    assert 600 <= moved <= 900  # about a quarter


def test_lru_policy_is_applied_to_the_servers(redis_servers):
    servers = redis_servers(2, restricted=False)  # a Redis without our ACL: the client configures it
    cache = ClusterCache([s.url for s in servers], capacity_bytes=1 << 20, policy="lru")
    cache.put_many([(CacheKey("fp", 1, "raw"), b"x")])
    for status in cache.stats()["servers"].values():
        assert status["maxmemory_policy"] == "allkeys-lru"
        assert status["maxmemory"] > 1 << 20
    minio = ClusterCache([s.url for s in servers], policy="minio")
    minio.get_many([CacheKey("fp", 1, "raw")])
    assert all(s["maxmemory_policy"] == "noeviction" for s in minio.stats()["servers"].values())


def test_full_server_reply_stops_admission(redis_servers):
    """A server at its maxmemory answers OOM: the client stops admitting there, reads go on."""
    (server,) = redis_servers(1, capacity_bytes=3 << 20, policy="minio")
    cache = ClusterCache([server.url], policy="minio")
    big = [(CacheKey("fp", i, "raw"), bytes([i]) * 200_000) for i in range(40)]
    for item in big:
        cache.put_many([item])
    got = cache.get_many([k for k, _ in big])
    held = [i for i, g in enumerate(got) if g is not None]
    assert 0 < len(held) < 40
    assert held == list(range(len(held)))  # first come, kept; never evicted
    assert all(got[i] == big[i][1] for i in held)
    status = cache.stats()["servers"][server.url]
    assert status["state"] == "full" and status["last_error"] == ""
    assert cache.stats()["errors"] == 0


def test_bad_configuration_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="at least one server"):
        ClusterCache([])
    with pytest.raises(ValueError, match="cannot read cache server 'http://x:1'"):
        ClusterCache(["http://x:1"])
    with pytest.raises(ValueError, match="duplicate cache servers"):
        ClusterCache(["redis://127.0.0.1:7000", "127.0.0.1:7000"])
    with pytest.raises(ValueError, match="unknown cache policy"):
        ClusterCache(["127.0.0.1:7000"], policy="random")
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"pip install 'stallfree\[redis\]'"):
        ClusterCache(["127.0.0.1:7000"])


def test_unreachable_server_is_misses_not_exceptions():
    cache = ClusterCache([f"127.0.0.1:{free_port()}"])
    k = CacheKey("fp", 1, "raw")
    assert cache.get_many([k]) == [None]
    cache.put_many([(k, b"x")])
    assert not cache.contains(k)
    stats = cache.stats()
    assert stats["errors"] >= 1 and stats["misses"] == 1
    assert "Connection" in next(iter(stats["servers"].values()))["last_error"]


def test_server_status_names_a_wrong_password_and_a_dead_server(redis_servers):
    (server,) = redis_servers(1, password="pw")
    assert server_status(server.url, password="pw")["url"] == server.url
    for wrong in (None, "nope"):
        with pytest.raises(ClusterCacheError, match=r"authentication failed \(check the cache password\)"):
            server_status(server.url, password=wrong, timeout_s=1.0)
    dead = f"redis://127.0.0.1:{free_port()}"
    with pytest.raises(ClusterCacheError, match=f"^{dead}: ConnectionError"):
        server_status(dead, timeout_s=1.0)


def test_server_that_cannot_start_is_a_clear_error_with_its_log(redis_servers, tmp_path):
    (running,) = redis_servers(1)
    clash = RedisServer(running.port, workdir=tmp_path / "clash")
    with pytest.raises(RuntimeError, match=r"(?s)redis-server exited with 1: .*already in use"):
        clash.start()
    clash.cleanup()
    # a wildcard bind is reached over loopback (not started: tests bind loopback only)
    assert RedisServer(7001, bind="0.0.0.0", workdir=tmp_path / "w").url == "redis://127.0.0.1:7001"


def test_a_port_it_chose_and_lost_before_binding_is_chosen_again(redis_servers, tmp_path, monkeypatch):
    # free_port()'s port can be taken by another process before redis-server binds it; a port the
    # caller gave is reported (above), one the server chose itself is picked again, once
    import stallfree.cache.server as server_mod

    (running,) = redis_servers(1)
    picks = iter([running.port])  # the first pick: already taken by the running server
    real = server_mod.free_port
    monkeypatch.setattr(server_mod, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    chosen = RedisServer(workdir=tmp_path / "chosen")
    assert chosen.port == running.port
    try:
        chosen.start()
        assert chosen.port != running.port
        assert server_status(chosen.url, password=None, timeout_s=5.0) is not None
    finally:
        chosen.cleanup()


@pytest.mark.parametrize("policy", ["minio", "lru"])
def test_corrupt_entries_are_dropped_wherever_a_lookup_finds_them(redis_servers, policy):
    servers = redis_servers(3)
    cache = ClusterCache([s.url for s in servers], 10_000_000, policy, configure_servers=False)
    keys = [CacheKey("fp", i, "raw") for i in range(12)]
    cache.put_encoded_many([(k.to_bytes(), b"SFcv-not-an-entry") for k in keys])
    assert all(cache.contains(k) for k in keys)
    assert cache.get_many(keys) == [None] * len(keys)
    assert cache.stats()["corrupt"] == len(keys)
    assert not any(cache.contains(k) for k in keys)
    cache.put_many([(k, b"ok") for k in keys])
    assert cache.get_many(keys) == [b"ok"] * len(keys)
    cache.close()
