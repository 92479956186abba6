"""Every entry carries its identity (dataset fingerprint, index, stage, key) and is served only
under that key; entries over ``max_entry_bytes`` are refused on put and dropped on lookup before
anything decodes them. Planted entries are tested in every tier (memory, node LMDB, a real Redis
cluster, tiered)."""

from __future__ import annotations

import struct
import zlib

import pytest

from stallfree.cache import codec
from stallfree.cache.base import CacheKey
from stallfree.cache.cluster import ClusterCache
from stallfree.cache.memory import MemoryCache
from stallfree.cache.node import NodeCache
from stallfree.cache.readthrough import read_through
from stallfree.cache.tiered import TieredCache
from stallfree.loader.dataloader import DataLoader
from stallfree.mix.mixture import mix
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from tests.cache.helpers import stored

N = 20


@pytest.fixture
def tar_ds(tmp_path):
    with ShardWriter(tmp_path / "tar", format="tar", max_samples=7) as w:
        for i in range(N):
            w.write({"__key__": f"{i:05d}", "jpg": bytes([i]) * 300, "cls": str(i % 3).encode()})
    return open_dataset(str(tmp_path / "tar"))


def keys_of(batches) -> list[str]:
    return [k for batch in batches for k in batch]


def plant(cache, key: CacheKey, blob: bytes) -> None:
    """Write ``blob`` under ``key`` the way any writer of the store could (no checks on the way)."""
    if isinstance(cache, TieredCache):
        for tier in cache.tiers:
            tier._put_raw([(key.to_bytes(), blob)])
    else:
        cache._put_raw([(key.to_bytes(), blob)])


def test_a_genuine_entry_under_other_keys_is_refused_in_every_tier(make_cache, tar_ds):
    """The reported failure: sample 00000's entry copied under every other index; one epoch
    delivered 00000 twenty times. Now each copy is a miss, deleted, and the real sample read."""
    cache = make_cache()
    fp = tar_ds.fingerprint
    read_through(tar_ds, [0], cache)
    genuine = cache.get_encoded_many([CacheKey(fp, 0, "raw").to_bytes()])[0]
    for i in range(1, N):
        plant(cache, CacheKey(fp, i, "raw"), genuine)
    loader = DataLoader(
        tar_ds, batch_size=4, cache=cache, seed=1, collate_fn=lambda b: [s["__key__"] for s in b]
    )
    assert sorted(keys_of(loader)) == [f"{i:05d}" for i in range(N)]
    # the copies were deleted and the real samples cached in their place
    got = cache.get_many([CacheKey(fp, i, "raw") for i in range(N)])
    assert [g["__key__"] for g in got] == [f"{i:05d}" for i in range(N)]
    assert loader.stats()["cache"]["mismatched"] == N - 1  # counted where the loader read them


@pytest.mark.parametrize(
    "identity, why",
    [
        (None, "no identity"),
        (codec.Identity("other-dataset", 3, "raw", "00003"), "of dataset other-dataset"),
        (codec.Identity("FP", 3, "decoded-224", "00003"), "(decoded-224)"),
        (codec.Identity("FP", 4, "raw", "00003"), "holds sample 4"),
        (codec.Identity("FP", 3, "raw", "00004"), "says it holds sample '00004', its value is '00003'"),
    ],
    ids=["none", "fingerprint", "stage", "index", "key"],
)
def test_an_entry_whose_identity_differs_is_a_miss_deleted_and_counted(
    make_cache, tar_ds, identity, why, caplog
):
    cache = make_cache()
    fp = tar_ds.fingerprint
    value = {"__key__": "00003", "jpg": bytes([3]) * 300, "cls": b"0"}
    if identity is not None and identity.fingerprint == "FP":
        identity = codec.Identity(fp, identity.index, identity.stage, identity.key)
    key = CacheKey(fp, 3, "raw")
    plant(cache, key, codec.encode(value, identity=identity))
    with caplog.at_level("WARNING"):
        assert cache.get_many([key]) == [None]
    assert why in caplog.text
    stats = cache.stats()
    assert (stats["mismatched"], stats["corrupt"], stats["hits"], stats["misses"]) == (1, 1, 0, 1)
    assert not cache.contains(key)


def test_identity_round_trips_and_is_covered_by_the_checksum():
    ident = codec.Identity("fp" * 16, 2**40, "raw", "ünï/cödé")
    blob = codec.encode({"__key__": "k", "x": b"1"}, identity=ident)
    entry = codec.decode_entry(blob)
    assert entry.identity == ident and entry.value == {"__key__": "k", "x": b"1"}
    assert codec.decode_entry(codec.encode(b"v", identity=codec.Identity("f", -1, "s"))).identity.key is None
    assert codec.decode_entry(codec.encode(b"v")).identity is None
    tampered = bytearray(blob)
    tampered[codec.HEADER_SIZE + 2] ^= 1  # the index's lowest byte: another sample
    with pytest.raises(codec.CodecError, match="checksum mismatch"):
        codec.decode_entry(bytes(tampered))


def test_a_version_1_entry_from_an_older_build_is_a_miss():
    payload = b"abc"
    old = struct.pack("<4sBBHIQ", b"SFcv", 1, 1, 0, zlib.crc32(payload), len(payload)) + payload
    cache = MemoryCache()
    key = CacheKey("fp", 0, "raw")
    cache._put_raw([(key.to_bytes(), old)])
    assert cache.get_many([key]) == [None]
    assert cache.stats()["corrupt"] == 1 and cache.stats()["mismatched"] == 0


def test_key_of_makes_the_raw_check_live_for_tar_arrow_and_manifestless_datasets(tmp_path, tar_ds):
    assert [tar_ds.key_of(i) for i in (0, 6, 7, 19)] == ["00000", "00006", "00007", "00019"]
    plain = open_dataset(str(tmp_path / "tar" / "*.tar"))  # no manifest: the scanned index
    assert [plain.key_of(i) for i in (0, 19)] == ["00000", "00019"]
    with ShardWriter(tmp_path / "arrow", format="arrow", max_samples=2) as w:
        for i in range(5):
            w.write({"__key__": f"a{i}", "cls": i})
    arrow = open_dataset(str(tmp_path / "arrow"))
    assert [arrow.key_of(i) for i in range(5)] == [f"a{i}" for i in range(5)]
    # a forged entry with a right identity but another sample's key: refused by the key check
    cache = MemoryCache()
    fp = tar_ds.fingerprint
    forged = {"__key__": "00002", "jpg": b"FORGED", "cls": b"1"}
    key = CacheKey(fp, 1, "raw")
    plant(cache, key, codec.encode(forged, identity=codec.Identity(fp, 1, "raw", "00002")))
    assert [s["__key__"] for s in read_through(tar_ds, [1], cache)] == ["00001"]
    assert cache.stats()["mismatched"] == 1


def test_a_mixture_refuses_an_earlier_epochs_sample_at_a_position(tmp_path, tar_ds):
    """Positions of a mixture map to other samples every epoch: a raw entry cached at position p
    in epoch 0 is another sample in epoch 1, and was served as if it were."""
    mixture = mix({"a": tar_ds}, {"a": 1.0}, seed=5)
    cache = MemoryCache()
    fp = mixture.fingerprint
    first = [s["__key__"] for s in read_through(mixture, range(N), cache, fingerprint=fp)]
    mixture.set_epoch(1)
    truth = [mixture.key_of(i) for i in range(N)]
    assert truth != first  # the epoch's permutation moved samples
    got = [s["__key__"] for s in read_through(mixture, range(N), cache, fingerprint=fp)]
    assert got == truth
    assert cache.stats()["mismatched"] == sum(a != b for a, b in zip(first, truth, strict=True))


# -- size cap ------------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "node", "cluster", "tiered"])
def capped(request, tmp_path, redis_servers_lazy):
    """A cache of each tier with ``max_entry_bytes=4096``."""
    made = []

    def make():
        tier, cap = request.param, 4096
        if tier == "memory":
            cache = MemoryCache(max_entry_bytes=cap)
        elif tier == "node":
            cache = NodeCache(tmp_path / "node", max_entry_bytes=cap)
        elif tier == "cluster":
            cache = ClusterCache([s.url for s in redis_servers_lazy(1)], max_entry_bytes=cap)
        else:
            cache = TieredCache(
                [MemoryCache(max_entry_bytes=cap), NodeCache(tmp_path / "t", max_entry_bytes=cap)]
            )
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


def test_oversized_values_are_refused_on_put_and_dropped_before_decoding_on_get(capped, monkeypatch):
    cache = capped()
    small, big = CacheKey("fp", 0, "raw"), CacheKey("fp", 1, "raw")
    cache.put_many([(small, b"x" * 100), (big, b"y" * 5000)])
    assert cache.stats()["oversized"] >= 1
    assert cache.get_many([small, big]) == [b"x" * 100, None]
    # an entry over the cap planted by a writer with a larger cap: dropped without a decode
    plant(cache, big, stored(big, b"z" * 5000))
    calls = []
    real = codec.decode_entry
    monkeypatch.setattr(codec, "decode_entry", lambda blob, *a: calls.append(len(blob)) or real(blob, *a))
    assert cache.get_many([big, small]) == [None, b"x" * 100]
    assert calls and all(n < 4096 for n in calls)
    assert cache.stats()["oversized"] >= 2
    assert not cache.contains(big)  # deleted


def test_the_default_cap_is_64_mib():
    assert MemoryCache().max_entry_bytes == 64 << 20
    cache = MemoryCache()
    cache.put_many([(CacheKey("fp", 0, "raw"), b"\0" * (65 << 20))])
    assert cache.stats()["oversized"] == 1 and cache.stats()["entries"] == 0


def test_max_entry_bytes_is_an_option_of_every_tier_and_survives_pickling(tmp_path):
    import pickle

    tiers = [
        MemoryCache(max_entry_bytes=1000),
        NodeCache(tmp_path / "n", max_entry_bytes=1000),
        ClusterCache(["127.0.0.1:1"], max_entry_bytes=1000),
    ]
    for tier in tiers:
        assert pickle.loads(pickle.dumps(tier)).max_entry_bytes == 1000
        tier.close()
    assert (
        TieredCache([MemoryCache(max_entry_bytes=10), MemoryCache(max_entry_bytes=99)]).max_entry_bytes == 99
    )
    with pytest.raises(ValueError, match="max_entry_bytes must be a positive integer"):
        MemoryCache(max_entry_bytes=0)
