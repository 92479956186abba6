"""A new cache tier is one file and no registration line (issue 23): users never pick a tier by
name (no CLI flag or bench option names one; ``stallfree cache`` only serves and inspects the
Redis tier), they pass a cache object. So a tier is a ``BaseCache`` subclass with the raw byte
primitives, and everything else (encoding, identity checks, counters, never-raise, pickling into
workers, ``TieredCache`` promotion, the loader's read-through) comes with the base class. The toy
tier below, one file per entry in a directory, is defined here and used through the loader."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from stallfree.cache import Cache, MemoryCache, TieredCache
from stallfree.cache.base import BaseCache, PutResult
from stallfree.loader.dataloader import DataLoader
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter

N = 24


class DirectoryCache(BaseCache):
    """One file per entry under ``root`` (shared by every process that opens the same root)."""

    name = "directory"

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root
        Path(root).mkdir(parents=True, exist_ok=True)

    def _config(self) -> dict[str, Any]:
        return {"root": self.root}

    def _path(self, key: bytes) -> Path:
        return Path(self.root) / hashlib.blake2b(key, digest_size=16).hexdigest()

    def _get_raw(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [p.read_bytes() if (p := self._path(k)).exists() else None for k in keys]

    def _put_raw(self, items: Sequence[tuple[bytes, bytes]]) -> PutResult:
        for key, blob in items:
            self._path(key).write_bytes(blob)
        return PutResult(len(items), sum(len(b) for _, b in items), 0)

    def _delete_raw(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def _tier_stats(self) -> dict[str, Any]:
        return {"entries": len(list(Path(self.root).iterdir()))}


@pytest.fixture
def shard_ds(tmp_path):
    with ShardWriter(str(tmp_path / "ds"), format="tar", max_samples=5) as w:
        for i in range(N):
            w.write({"__key__": f"s{i:04d}", "txt": f"sample {i}".encode()})
    return open_dataset(str(tmp_path / "ds"))


def _samples(loader) -> dict[str, bytes]:
    return {k: t for b in loader for k, t in zip(b["__key__"], b["txt"], strict=True)}


WRITTEN = {f"s{i:04d}": f"sample {i}".encode() for i in range(N)}


def test_a_new_tier_speaks_the_cache_protocol(tmp_path):
    assert isinstance(DirectoryCache(str(tmp_path / "c")), Cache)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_new_tier_serves_a_warm_epoch_through_the_loader(shard_ds, tmp_path, num_workers):
    cache = DirectoryCache(str(tmp_path / "c"))
    loader = DataLoader(shard_ds, batch_size=4, shuffle=True, seed=2, cache=cache, num_workers=num_workers)
    assert _samples(loader) == WRITTEN
    cold = loader.stats()["cache"]
    assert (cold["read_storage_reads"], cold["entries"]) == (N, N)
    assert _samples(loader) == WRITTEN
    warm = loader.stats()["cache"]
    assert warm["read_storage_reads"] == N and warm["read_cache_hits"] == N  # the 2nd epoch: all hits


def test_a_new_tier_stacks_under_memory_in_a_tiered_cache(shard_ds, tmp_path):
    """Entries written through a tiered cache land in the new tier; a fresh process-local memory
    tier in front is filled from it (promotion) without touching storage."""
    below = DirectoryCache(str(tmp_path / "c"))
    first = DataLoader(shard_ds, batch_size=6, seed=0, cache=TieredCache([MemoryCache(), below]))
    assert _samples(first) == WRITTEN
    front = MemoryCache()
    second = DataLoader(shard_ds, batch_size=6, seed=0, cache=TieredCache([front, below]))
    assert _samples(second) == WRITTEN
    assert second.stats()["cache"]["read_cache_hits"] == N
    assert front.stats()["entries"] == N  # promoted from the directory tier
