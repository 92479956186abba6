"""A malformed entry in the node tier (planted straight into its LMDB tables) is a miss, counted under
``corrupt``, and deleted from the store with its byte budget and LRU bookkeeping."""

from __future__ import annotations

import struct

import pytest

from stallfree.cache import codec, lmdbenv
from stallfree.cache.base import CacheKey
from stallfree.cache.node import NodeCache
from tests.cache.helpers import stored

N = 12
BAD = {3: "flipped payload byte", 5: "bad magic", 7: "truncated header", 9: "length beyond buffer"}
U64 = struct.Struct("<Q")


def key(i: int) -> CacheKey:
    return CacheKey("fp", i, "raw")


def value(i: int) -> bytes:
    return bytes([i % 251]) * (500 + i)


def corrupt(blob: bytes, how: str) -> bytes:
    if how == "flipped payload byte":
        return blob[:-1] + bytes([blob[-1] ^ 0xFF])
    if how == "bad magic":
        return b"XXXX" + blob[4:]
    if how == "truncated header":
        return blob[:7]
    # the header's payload length field (the last 8 header bytes) claims far more than is there
    return blob[: codec.HEADER_SIZE - 8] + U64.pack(1 << 40) + blob[codec.HEADER_SIZE :]


def plant(cache: NodeCache, bad: dict[int, str]) -> None:
    """Overwrite entries in place, keeping the store's byte count in step as a writer would."""
    with lmdbenv.using():
        handle = lmdbenv.acquire(cache.path, cache.map_size)
        data, meta = handle.dbs[0], handle.dbs[1]
        with handle.env.begin(write=True) as txn:
            used = U64.unpack(txn.get(b"used", db=meta))[0]
            for i, how in bad.items():
                kb = key(i).to_bytes()
                old = txn.get(kb, db=data)
                new = corrupt(old, how)
                txn.put(kb, new, db=data)
                used += len(new) - len(old)
            txn.put(b"used", U64.pack(used), db=meta)
        lmdbenv.release(cache.path, handle)


def table_entries(cache: NodeCache, index: int) -> int:
    with lmdbenv.using():
        handle = lmdbenv.acquire(cache.path, cache.map_size)
        with handle.env.begin() as txn:
            n = txn.stat(handle.dbs[index])["entries"]
        lmdbenv.release(cache.path, handle)
    return n


@pytest.mark.parametrize("policy", ["minio", "lru"])
def test_corrupt_entries_are_misses_and_deleted(tmp_path, policy):
    cache = NodeCache(tmp_path / "node", capacity_bytes=1 << 20, policy=policy)
    cache.put_many([(key(i), value(i)) for i in range(N)])
    plant(cache, BAD)
    for i, how in BAD.items():  # each planted form really is malformed
        with pytest.raises(codec.CodecError):
            codec.decode(corrupt(stored(key(i), value(i)), how))

    got = cache.get_many([key(i) for i in range(N)])
    assert got == [None if i in BAD else value(i) for i in range(N)]
    stats = cache.stats()
    assert (stats["corrupt"], stats["misses"], stats["hits"]) == (len(BAD), len(BAD), N - len(BAD))
    good = [i for i in range(N) if i not in BAD]
    assert stats["entries"] == len(good)
    assert stats["used_bytes"] == sum(len(stored(key(i), value(i))) for i in good)
    assert not any(cache.contains(key(i)) for i in BAD)
    if policy == "lru":  # atime and order tables lose them too
        assert table_entries(cache, 2) == table_entries(cache, 3) == len(good)

    # gone, not still there: the next lookup is a plain miss, and a fresh store reads back intact
    assert cache.get_many([key(i) for i in BAD]) == [None] * len(BAD)
    assert cache.stats()["corrupt"] == len(BAD)
    cache.put_many([(key(i), value(i)) for i in BAD])
    assert cache.get_many([key(i) for i in range(N)]) == [value(i) for i in range(N)]
    cache.close()


def test_another_process_sees_the_corrupt_entry_gone(tmp_path):
    """The delete is in the shared store, not a per-process memory of bad keys."""
    first = NodeCache(tmp_path / "node")
    first.put_many([(key(i), value(i)) for i in range(N)])
    plant(first, {3: "flipped payload byte"})
    assert first.get_many([key(3)]) == [None]
    second = NodeCache(tmp_path / "node")  # a second cache object on the same store
    assert not second.contains(key(3))
    assert second.get_many([key(3)]) == [None] and second.stats()["corrupt"] == 0
    first.close()
    second.close()
