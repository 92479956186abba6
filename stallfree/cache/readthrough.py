"""Read-through access: cache first, storage for the misses, then fill the cache.

This is the one function the loader calls for cached fetches; ``ReadStats`` counts what came from
where, so tests and benchmarks can check that a warm epoch touches storage zero times.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from stallfree.cache.base import Cache, CacheKey
from stallfree.cache.expect import raw_check


class ReadStats:
    """Counters of ``read_through`` calls: samples asked for, served by the cache, read from storage."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.samples = 0
        self.cache_hits = 0
        self.storage_reads = 0

    def add(self, samples: int, hits: int) -> None:
        with self._lock:
            self.samples += samples
            self.cache_hits += hits
            self.storage_reads += samples - hits

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "samples": self.samples,
                "cache_hits": self.cache_hits,
                "storage_reads": self.storage_reads,
                "hit_rate": self.cache_hits / self.samples if self.samples else 0.0,
            }


def dataset_fingerprint(dataset: Any) -> str:
    """The dataset's content id used in cache keys (``ShardedDataset.fingerprint``)."""
    fp = getattr(dataset, "fingerprint", None)
    if not isinstance(fp, str) or not fp:
        raise TypeError(
            f"{type(dataset).__name__} has no 'fingerprint' string; caching needs a stable content id "
            "(open the dataset with stallfree.open_dataset, or pass fingerprint=...)"
        )
    return fp


def read_through(
    dataset: Any,
    indices: Sequence[int],
    cache: Cache | None,
    stage: str = "raw",
    *,
    fingerprint: str | None = None,
    stats: ReadStats | None = None,
) -> list[dict[str, Any]]:
    """Samples ``indices`` of ``dataset`` in order, from ``cache`` where present.

    Misses are fetched in one batched ``dataset.get_many`` call (or ``dataset[i]`` one by one when
    the dataset has no ``get_many``) and offered to the cache; the cache's policy decides what it
    keeps. Cache failures are misses (the tiers never raise); storage errors propagate unchanged.
    Under the ``raw`` stage a cached entry must look like the dataset's own sample
    (``expect.raw_check``), else it is a miss and deleted.
    """
    indices = [int(i) for i in indices]
    if cache is None:
        samples = _fetch(dataset, indices)
        if stats is not None:
            stats.add(len(indices), 0)
        return samples
    fp = fingerprint if fingerprint is not None else dataset_fingerprint(dataset)
    keys = [CacheKey(fp, i, stage) for i in indices]
    found = cache.get_many(keys, check=raw_check(dataset) if stage == "raw" else None)
    missing = [pos for pos, value in enumerate(found) if value is None]
    if missing:
        fetched = _fetch(dataset, [indices[pos] for pos in missing])
        fresh = []
        for pos, sample in zip(missing, fetched, strict=True):
            found[pos] = sample
            fresh.append((keys[pos], sample))
        cache.put_many(fresh)
    if stats is not None:
        stats.add(len(indices), len(indices) - len(missing))
    return found  # type: ignore[return-value]


def _fetch(dataset: Any, indices: list[int]) -> list[dict[str, Any]]:
    if not indices:
        return []
    get_many = getattr(dataset, "get_many", None)
    if get_many is not None:
        samples = list(get_many(indices))
        if len(samples) != len(indices):
            raise RuntimeError(f"dataset.get_many returned {len(samples)} samples for {len(indices)} indices")
        return samples
    return [dataset[i] for i in indices]
