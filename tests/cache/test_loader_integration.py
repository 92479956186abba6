"""The cache behind stallfree.DataLoader, on real tar shards served over loopback HTTP (fsspec).

Storage reads are counted by the HTTP server itself: a warm epoch must not touch the shards.
"""

from __future__ import annotations

import time

import pytest

from stallfree.cache.cluster import ClusterCache
from stallfree.cache.memory import MemoryCache
from stallfree.cache.node import NodeCache
from stallfree.cache.tiered import TieredCache
from stallfree.testing.httpserve import serve_directory
from stallfree.testing.images import jpeg_bytes

DataLoader = pytest.importorskip("stallfree.loader.dataloader").DataLoader
open_dataset = pytest.importorskip("stallfree.shards.open").open_dataset
ShardWriter = pytest.importorskip("stallfree.shards.writer").ShardWriter

N = 120


@pytest.fixture
def http_shards(tmp_path):
    images = jpeg_bytes(6, seed=3, sizes=((160, 120), (120, 160)))
    with ShardWriter(tmp_path / "ds", format="tar", max_samples=30) as writer:
        for i in range(N):
            writer.write({"__key__": f"s{i:04d}", "jpg": images[i % 6], "cls": str(i % 4).encode()})
    with serve_directory(tmp_path) as server:
        yield server


def keys_of(batch):
    return [s["__key__"] for s in batch]


def tar_requests(server) -> int:
    return sum(n for path, n in server.stats.paths.items() if path.endswith(".tar"))


@pytest.mark.parametrize("tiers", ["memory+cluster", "node", "memory+node+cluster"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_warm_epoch_reads_no_shard_bytes(http_shards, redis_servers, tmp_path, tiers, num_workers):
    servers = redis_servers(3) if "cluster" in tiers else []
    ds = open_dataset(http_shards.url + "/ds")
    make = {
        "memory": lambda: MemoryCache(1 << 20),
        "node": lambda: NodeCache(tmp_path / "node", 1 << 30),
        "cluster": lambda: ClusterCache([s.url for s in servers]),
    }
    cache = TieredCache([make[t]() for t in tiers.split("+")])
    loader = DataLoader(ds, batch_size=8, cache=cache, seed=1, collate_fn=keys_of, num_workers=num_workers)
    epochs = []
    for _ in range(3):
        http_shards.stats.reset()
        keys = [k for batch in loader for k in batch]
        epochs.append((sorted(keys), tar_requests(http_shards)))
    expected = sorted(f"s{i:04d}" for i in range(N))
    assert [e[0] for e in epochs] == [expected] * 3
    assert epochs[0][1] > 0
    assert epochs[1][1] == 0 and epochs[2][1] == 0
    if num_workers == 0:  # (with workers, per-process memory tiers see their own misses)
        assert loader.stats()["cache"]["misses"] == N


@pytest.mark.parametrize("num_workers", [0, 2])
def test_server_killed_mid_epoch_through_the_loader(http_shards, redis_servers, num_workers):
    servers = redis_servers(3)
    ds = open_dataset(http_shards.url + "/ds")
    cache = ClusterCache([s.url for s in servers], backoff_s=0.05, max_backoff_s=0.2)
    loader = DataLoader(ds, batch_size=8, cache=cache, seed=1, collate_fn=keys_of, num_workers=num_workers)
    assert len([k for b in loader for k in b]) == N  # epoch 1 fills the cluster
    http_shards.stats.reset()
    keys = []
    for step, batch in enumerate(loader):
        if step == 5:
            servers[0].kill()
        keys += batch
    assert sorted(keys) == sorted(f"s{i:04d}" for i in range(N))  # each sample exactly once
    assert tar_requests(http_shards) > 0  # the dead node's share came from storage
    assert loader.stats()["cache"]["errors"] >= 1

    servers[0].start()  # restarted on the same port, empty
    time.sleep(0.3)  # past the breaker's backoff
    assert sorted(k for b in loader for k in b) == sorted(f"s{i:04d}" for i in range(N))  # refills it
    http_shards.stats.reset()
    assert sorted(k for b in loader for k in b) == sorted(f"s{i:04d}" for i in range(N))
    assert tar_requests(http_shards) == 0  # the restarted node serves its share again
    probe = ClusterCache([servers[0].url])
    assert probe.stats()["servers"][servers[0].url]["keys"] > 1
