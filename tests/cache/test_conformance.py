"""One suite every tier passes (MemoryCache, NodeCache, ClusterCache, TieredCache)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from stallfree.cache import codec
from stallfree.cache.base import Cache, CacheKey
from tests.cache.helpers import stored


def key(i: int, stage: str = "raw", fp: str = "fp1") -> CacheKey:
    return CacheKey(fp, i, stage)


def blob_sample(i: int, size: int = 1000) -> dict:
    return {"__key__": f"k{i:05d}", "jpg": bytes([i % 256]) * size, "cls": i}


def entry_size(value, k: CacheKey | None = None) -> int:
    """Bytes an entry takes in a tier (the identity included: key 0's when ``k`` is not given)."""
    return len(stored(k if k is not None else key(0), value))


def present(cache, keys) -> set:
    return {k for k, v in zip(keys, cache.get_many(keys), strict=True) if v is not None}


def test_speaks_the_protocol(make_cache):
    assert isinstance(make_cache(), Cache)


def test_round_trip_sample_dict_bytes_and_arrays(make_cache):
    cache = make_cache()
    rng = np.random.default_rng(0)
    sample = {
        "__key__": "n01440764_10026",
        "jpg": rng.bytes(50_000),
        "txt": "a caption, with ünïcode ✓",
        "cls": 417,
        "big": 2**80,
        "neg": -5,
        "score": 0.125,
        "flag": True,
        "none": None,
        "image": rng.integers(0, 255, (37, 23, 3), dtype=np.uint8),
        "emb": rng.standard_normal(17).astype(">f8"),  # big-endian survives
        "mask": rng.integers(0, 2, (4, 5)).astype(bool),
        "strided": np.arange(60, dtype=np.int32).reshape(6, 10)[:, ::3],
        "scalar": np.array(7, dtype=np.int16),
        "empty": np.zeros((0, 4), np.float32),
    }
    raw = rng.bytes(123_457)
    arr = rng.standard_normal((16, 16)).astype(np.float16)
    cache.put_many([(key(1), sample), (key(2), raw), (key(3), arr), (key(4), b"")])
    got = cache.get_many([key(1), key(2), key(3), key(4), key(5)])
    assert got[4] is None
    assert got[1] == raw and isinstance(got[1], bytes)
    assert got[3] == b""
    assert got[2].dtype == arr.dtype and got[2].shape == arr.shape and np.array_equal(got[2], arr)
    out = got[0]
    assert set(out) == set(sample)
    for name, value in sample.items():
        if isinstance(value, np.ndarray):
            assert out[name].dtype == value.dtype, name
            assert out[name].shape == value.shape, name
            assert np.array_equal(out[name], value), name
            assert out[name].flags.writeable
        else:
            assert out[name] == value and type(out[name]) is type(value), name


def test_stages_and_fingerprints_are_separate_keys(make_cache):
    cache = make_cache()
    cache.put_many([(key(0, "raw"), b"raw"), (key(0, "decoded-224"), b"dec"), (key(0, fp="other"), b"o")])
    assert cache.get_many([key(0, "raw"), key(0, "decoded-224"), key(0, fp="other")]) == [
        b"raw",
        b"dec",
        b"o",
    ]


def test_miss_and_contains(make_cache):
    cache = make_cache()
    assert cache.get_many([key(10), key(11)]) == [None, None]
    assert cache.get_many([]) == []
    cache.put_many([])
    cache.put_many([(key(10), b"x")])
    assert cache.contains(key(10)) and not cache.contains(key(11))


def test_bad_budget_is_a_clear_error(make_cache):
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0, got -"):
        make_cache(-3)
    with pytest.raises(ValueError, match="unknown cache policy"):
        make_cache(None, "fifo")


def test_existing_entries_are_not_overwritten(make_cache):
    # entries are immutable: the same key always means the same content
    cache = make_cache()
    cache.put_many([(key(1), b"first")])
    cache.put_many([(key(1), b"second")])
    assert cache.get_many([key(1)]) == [b"first"]


def test_stats_count_hits_misses_and_bytes(make_cache):
    cache = make_cache()
    values = [blob_sample(i) for i in range(3)]
    cache.put_many([(key(i), v) for i, v in enumerate(values)])
    before = cache.stats()
    cache.get_many([key(0), key(1), key(2), key(7), key(8)])
    after = cache.stats()
    assert after["hits"] - before["hits"] == 3
    assert after["misses"] - before["misses"] == 2
    assert after["bytes_out"] - before["bytes_out"] == sum(
        entry_size(v, key(i)) for i, v in enumerate(values)
    )
    assert after["bytes_in"] == sum(entry_size(v, key(i)) for i, v in enumerate(values))
    assert after["admitted"] == 3
    assert after["errors"] == 0 and after["corrupt"] == 0
    assert after["get_calls"] - before["get_calls"] == 1
    assert after["get_latency_ms"] >= 0.0
    for field in ("evictions", "hit_rate", "put_latency_ms", "bytes_in", "bytes_out"):
        assert field in after


def test_unencodable_value_is_counted_not_raised(make_cache):
    cache = make_cache()
    cache.put_many([(key(1), {"obj": object()}), (key(2), b"ok"), (key(3), {1, 2})])
    assert cache.get_many([key(1), key(2), key(3)]) == [None, b"ok", None]
    assert cache.stats()["errors"] == 2


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip", "magic", "version", "extend"],
)
def test_corrupt_entry_is_a_miss_and_deleted(make_cache, damage, caplog):
    cache = make_cache()
    good = codec.encode(blob_sample(5))
    bad = bytearray(good)
    if damage == "truncate":
        bad = bad[: len(bad) - 10]
    elif damage == "flip":
        bad[-3] ^= 0xFF
    elif damage == "magic":
        bad[0:4] = b"XXXX"
    elif damage == "version":
        bad[4] = 99
    else:
        bad += b"junk"
    k = key(5).to_bytes()
    cache.put_encoded_many([(k, bytes(bad))])
    assert cache.contains(key(5))
    with caplog.at_level("WARNING"):
        assert cache.get_many([key(5)]) == [None]
    assert "corrupt" in caplog.text
    stats = cache.stats()
    assert stats["corrupt"] == 1 and stats["misses"] == 1 and stats["hits"] == 0
    assert not cache.contains(key(5))
    # and the slot is usable again
    cache.put_many([(key(5), blob_sample(5))])
    assert cache.get_many([key(5)]) == [blob_sample(5)]


def test_minio_admits_until_full_and_never_evicts(make_cache):
    size = entry_size(blob_sample(0, make_cache.item_size))
    capacity = 12 * size
    cache = make_cache(capacity, "minio")
    keys = [key(i) for i in range(40)]
    cache.put_many([(keys[i], blob_sample(i, make_cache.item_size)) for i in range(20)])
    early = present(cache, keys)
    for start in range(20, 40, 5):
        cache.put_many([(keys[i], blob_sample(i, make_cache.item_size)) for i in range(start, start + 5)])
    late = present(cache, keys)
    assert early <= late  # nothing admitted was ever evicted
    assert len(late) * size <= capacity
    assert len(late) >= 10  # filled (a cluster loses at most a slot per server to rounding)
    stats = cache.stats()
    assert stats["evictions"] == 0
    assert stats["rejected"] >= 40 - len(late)
    for k, v in zip(keys, cache.get_many(keys), strict=True):
        assert v is None or v == blob_sample(k.index, make_cache.item_size)


def test_lru_evicts_least_recently_used(make_cache):
    size = entry_size(blob_sample(0, make_cache.item_size))
    cache = make_cache(12 * size, "lru")
    keys = [key(i) for i in range(40)]
    for i in range(40):
        cache.put_many([(keys[i], blob_sample(i, make_cache.item_size))])
        if make_cache.exact_lru and i >= 1:
            cache.get_many([keys[0]])  # keep key 0 hot
    now = present(cache, keys)
    assert keys[39] in now
    assert len(now) < 40
    assert cache.stats()["evictions"] > 0
    if make_cache.exact_lru:
        assert {keys[0], *keys[29:]} <= now  # the hot key and the 11 most recent
        # a tiered cache holds the union of its tiers: key 28 may survive below the memory tier,
        # which kept key 0 hot without the node tier seeing those hits
        assert len(now) == 12 or (make_cache.tier == "tiered" and now == {keys[0], *keys[28:]})


def test_pickle_keeps_config_and_reconnects(make_cache):
    cache = make_cache(1 << 20, "lru")
    cache.put_many([(key(1), b"shared?")])
    clone = pickle.loads(pickle.dumps(cache))
    assert type(clone) is type(cache)
    assert clone.stats()["hits"] == 0  # counters are per process, not pickled
    got = clone.get_many([key(1)])
    assert got == ([b"shared?"] if make_cache.shared else [None]) or make_cache.tier == "tiered"
    if make_cache.tier == "tiered":
        assert got == [b"shared?"]  # the node tier under it is shared
    clone.put_many([(key(2), b"from clone")])
    assert clone.get_many([key(2)]) == [b"from clone"]
    clone.close()


def test_close_is_idempotent(make_cache):
    cache = make_cache()
    cache.put_many([(key(1), b"x")])
    cache.close()
    cache.close()


def _share_worker(cache, rank: int, conn) -> None:
    keys = [key(i) for i in range(4 * 10)]
    cache.put_many([(keys[i], blob_sample(i, 300)) for i in range(rank * 10, rank * 10 + 10)])
    conn.send(rank)
    conn.recv()  # wait until every process has written
    got = cache.get_many(keys)
    conn.send(sum(g == blob_sample(i, 300) for i, g in enumerate(got)))


def test_processes_share_one_cache(make_cache):
    """Four forked processes each write a quarter; each then reads all (shared tiers only)."""
    if not make_cache.shared and make_cache.tier != "tiered":
        pytest.skip("a MemoryCache is private to its process")
    import multiprocessing as mp

    cache = make_cache()
    cache.get_many([key(0)])  # open connections/handles in the parent before forking
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for rank in range(4):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_share_worker, args=(cache, rank, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    assert sorted(p.recv() for p in pipes) == [0, 1, 2, 3]
    for p in pipes:
        p.send("go")
    counts = [p.recv() for p in pipes]
    for proc in procs:
        proc.join(30)
    assert counts == [40, 40, 40, 40]
    assert cache.get_many([key(i) for i in range(40)]) == [blob_sample(i, 300) for i in range(40)]
