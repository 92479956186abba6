"""The fast path over real tar shards (open_dataset), block order, and cache read-through."""

from __future__ import annotations

import numpy as np
import pytest

from stallfree.loader.dataloader import DataLoader

shards = pytest.importorskip("stallfree.shards.open")
writer = pytest.importorskip("stallfree.shards.writer")
memory = pytest.importorskip("stallfree.cache.memory")


@pytest.fixture
def shard_ds(tmp_path):
    with writer.ShardWriter(str(tmp_path / "ds"), format="tar", max_samples=7) as w:
        for i in range(40):
            w.write({"__key__": f"s{i:04d}", "txt": f"sample {i}".encode(), "cls": str(i % 3).encode()})
    return shards.open_dataset(str(tmp_path / "ds"))


def _keys(loader):
    return [k for b in loader for k in b["__key__"]]


def test_sharded_dataset_three_ranks_two_workers_block_order(shard_ds):
    assert shard_ds.shard_sizes == [7, 7, 7, 7, 7, 5]
    per_rank = [
        _keys(
            DataLoader(
                shard_ds,
                batch_size=4,
                shuffle=True,
                num_workers=2,
                seed=1,
                world=(r, 3),
                order="block",
                window=2,
            )
        )
        for r in range(3)
    ]
    flat = sum(per_rank, [])
    assert {len(p) for p in per_rank} == {14}
    assert set(flat) == {f"s{i:04d}" for i in range(40)} and len(flat) == 42
    # block order: the epoch's positions run through windows of 2 shards, one window at a time
    order = DataLoader(shard_ds, batch_size=40, shuffle=True, seed=1, order="block", window=2)
    shard_of = [int(k[1:]) // 7 for k in _keys(order)]
    pos = 0
    while pos < 40:
        window = list(dict.fromkeys(shard_of[pos:]))[:2]  # the next window's shards appear first
        size = sum(shard_ds.shard_sizes[s] for s in window)
        assert set(shard_of[pos : pos + size]) == set(window)
        pos += size


def test_sharded_dataset_without_shuffle_is_sequential_and_fast_path(shard_ds):
    dl = DataLoader(shard_ds, batch_size=8, num_workers=2)
    assert dl.fast_path
    assert _keys(dl) == [f"s{i:04d}" for i in range(40)]


def test_sample_bytes_are_those_written(shard_ds):
    for b in DataLoader(shard_ds, batch_size=5, shuffle=True, seed=0, num_workers=2):
        for key, txt in zip(b["__key__"], b["txt"], strict=True):
            assert txt == f"sample {int(key[1:])}".encode()


class CountingDecode:
    """A deterministic per-sample decode with a cache stage; counts its calls (in-process)."""

    cache_stage = "parsed"

    def __init__(self):
        self.calls = 0

    def __call__(self, sample):
        self.calls += 1
        return {"__key__": sample["__key__"], "n": np.array([int(sample["txt"].split()[1])], dtype=np.int64)}


def test_decoded_stage_cache_skips_fetch_and_decode_on_second_epoch(shard_ds):
    dec = CountingDecode()
    dl = DataLoader(shard_ds, batch_size=8, shuffle=True, seed=0, decode=dec, cache=memory.MemoryCache())
    first = sorted(int(n) for b in dl for n in b["n"].flatten().tolist())
    assert first == list(range(40)) and dec.calls == 40
    second = sorted(int(n) for b in dl for n in b["n"].flatten().tolist())
    assert second == first and dec.calls == 40  # every sample came from the decoded cache
    st = dl.stats()["cache"]
    assert st is not None


def test_raw_cache_read_through_counts_storage_reads(shard_ds):
    dl = DataLoader(shard_ds, batch_size=8, shuffle=True, seed=0, cache=memory.MemoryCache())
    assert len(_keys(dl)) == 40
    assert dl.stats()["cache"]["read_storage_reads"] == 40
    assert len(_keys(dl)) == 40
    c = dl.stats()["cache"]
    assert c["read_storage_reads"] == 40 and c["read_cache_hits"] == 40


def test_remote_shards_over_loopback_http_with_concurrent_fetches(tmp_path, shard_ds):
    from stallfree.testing.httpserve import serve_directory

    with serve_directory(tmp_path / "ds", latency_s=0.002) as srv:
        remote = shards.open_dataset(srv.url)
        dl = DataLoader(
            remote, batch_size=4, shuffle=True, seed=3, num_workers=1, prefetch_factor=4, fetch_threads=3
        )
        assert dl._plan.order == "block"
        keys = _keys(dl)
        assert sorted(keys) == [f"s{i:04d}" for i in range(40)]
        for b in DataLoader(remote, batch_size=8, shuffle=True, seed=3, num_workers=2, fetch_threads=2):
            for key, txt in zip(b["__key__"], b["txt"], strict=True):
                assert txt == f"sample {int(key[1:])}".encode()
        assert srv.stats.range_requests > 0


def test_cache_stats_with_two_workers_sum_counters_and_recompute_ratios(shard_ds, tmp_path):
    """Half the samples are in a shared node cache before the epoch: the loader's hit rate is
    exactly 0.5 with 2 workers (ratios are recomputed from summed counts, never summed)."""
    node = pytest.importorskip("stallfree.cache.node")
    from stallfree.cache.readthrough import read_through

    cache = node.NodeCache(tmp_path / "node")
    read_through(shard_ds, list(range(0, 40, 2)), cache)  # warm the even samples
    dl = DataLoader(shard_ds, batch_size=4, shuffle=True, seed=3, num_workers=2, cache=cache)
    assert sorted(_keys(dl)) == [f"s{i:04d}" for i in range(40)]
    c = dl.stats()["cache"]
    assert c["hits"] == 20 and c["misses"] == 20
    assert c["hit_rate"] == 0.5
    assert c["read_samples"] == 40 and c["read_cache_hits"] == 20 and c["read_storage_reads"] == 20
    assert c["read_hit_rate"] == 0.5
    assert c["get_latency_ms"] == pytest.approx(1000.0 * c["get_seconds"] / c["get_calls"])
    assert c["entries"] == 40  # a level of the shared cache, not a sum over workers
    cache.close()


def test_cache_reports_of_two_workers_add_counters_not_ratios():
    from stallfree.loader.stats import LoaderStats

    st = LoaderStats()
    for wid in (0, 1):  # each worker: 3 hits, 1 miss (its own hit_rate 0.75), 4 entries
        st.add_cache({"hits": 3, "misses": 1, "hit_rate": 0.75, "entries": 4 + wid}, wid)
    st.add_cache({"hits": 0, "misses": 4, "entries": 6}, 0)
    c = st.as_dict()["cache"]
    assert c == {"hits": 6, "misses": 6, "hit_rate": 0.5, "entries": 6}


def _head_and_state(ds, limit, **kw):
    import json

    loader = DataLoader(ds, batch_size=4, shuffle=True, seed=3, order="block", **kw)
    head = []
    for b, batch in enumerate(loader, 1):
        head += batch["__key__"]
        if b == limit:
            break
    return loader, head, json.loads(json.dumps(loader.state_dict()))


def test_a_state_names_its_block_layout_and_resumes_exactly_under_it(shard_ds):
    whole = _keys(DataLoader(shard_ds, batch_size=4, shuffle=True, seed=3, order="block", window=4))
    _, head, state = _head_and_state(shard_ds, 3, window=4)
    assert state["order"] == "block/r1/window=4" and state["consumed"] == 12
    again = DataLoader(shard_ds, batch_size=4, shuffle=True, seed=3, order="block", window=4)
    again.load_state_dict(state)
    assert head + _keys(again) == whole


@pytest.mark.parametrize(
    "other",
    [
        {"order": "block", "window": 2},
        {"order": "global"},
        {"order": "block", "window": 4, "_old": "block/r0/window=4"},
    ],
)
def test_a_state_is_refused_mid_epoch_under_another_layout(shard_ds, other):
    # a window or order changed between save and resume maps the saved positions to other
    # samples: the rest of the epoch would skip some and repeat others, with no error
    _, _, state = _head_and_state(shard_ds, 3, window=4)
    other = dict(other)
    if "_old" in other:  # a state saved by a build whose block layout had another revision
        state["order"] = other.pop("_old")
    again = DataLoader(shard_ds, batch_size=4, shuffle=True, seed=3, **other)
    with pytest.raises(ValueError, match=r"12 positions into an epoch of order 'block/r\d/window=4'.*skip"):
        again.load_state_dict(state)


def test_at_an_epoch_boundary_another_layout_is_fine(shard_ds):
    first = DataLoader(shard_ds, batch_size=4, shuffle=True, seed=3, order="block", window=4)
    _keys(first)  # the whole epoch: the state points at the next one's start
    state = first.state_dict()
    assert state["consumed"] == 0 and state["epoch"] == 1
    again = DataLoader(shard_ds, batch_size=4, shuffle=True, seed=3, order="block", window=2)
    again.load_state_dict(state)
    expect = DataLoader(shard_ds, batch_size=4, shuffle=True, seed=3, order="block", window=2)
    expect.set_epoch(1)
    assert _keys(again) == _keys(expect)
