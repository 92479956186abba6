"""Read-through access: cache first, storage for the misses, then fill the cache.

This is the one function the loader calls for cached fetches; ``ReadStats`` counts what came from
where, so tests and benchmarks can check that a warm epoch touches storage zero times.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from stallfree.cache.base import Cache, CacheKey
from stallfree.cache.expect import raw_check

logger = logging.getLogger(__name__)


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
    fetch: Callable[[list[int]], list[Any]] | None = None,
) -> list[Any]:
    """Samples ``indices`` of ``dataset`` in order, from ``cache`` where present.

    Misses are fetched in one batched ``dataset.get_many`` call (or ``dataset[i]`` one by one when
    the dataset has no ``get_many``) and offered to the cache; the cache's policy decides what it
    keeps. Cache failures are misses (the tiers never raise; a cache object that does is logged
    and treated so); storage errors propagate unchanged. Under the ``raw`` stage a cached entry
    must look like the dataset's own sample (``expect.raw_check``), else it is a miss and deleted.

    ``fetch(missing_indices)`` replaces the storage read for a stage of another form: the loader's
    stage cache reads and decodes its misses this way, so raw and decoded entries share this one
    path. A value it returns as an exception (a sample that failed) is handed back in its place and
    never cached.
    """
    indices = [int(i) for i in indices]
    read = fetch if fetch is not None else (lambda missing: _fetch(dataset, missing))
    if cache is None:
        samples = read(indices)
        if stats is not None:
            stats.add(len(indices), 0)
        return samples
    fp = fingerprint if fingerprint is not None else dataset_fingerprint(dataset)
    keys = [CacheKey(fp, i, stage) for i in indices]
    found = _lookup(cache, keys, raw_check(dataset) if stage == "raw" else None)
    missing = [pos for pos, value in enumerate(found) if value is None]
    if missing:
        fetched = read([indices[pos] for pos in missing])
        if len(fetched) != len(missing):
            raise RuntimeError(f"the read returned {len(fetched)} samples for {len(missing)} indices")
        fresh = []
        for pos, sample in zip(missing, fetched, strict=True):
            found[pos] = sample
            if not isinstance(sample, BaseException):
                fresh.append((keys[pos], sample))
        _store(cache, fresh)
    if stats is not None:
        stats.add(len(indices), len(indices) - len(missing))
    return found


def _lookup(cache: Cache, keys: list[CacheKey], check: Any) -> list[Any]:
    try:
        found = list(cache.get_many(keys, check=check))
    except Exception:  # noqa: BLE001 - a broken tier is a miss
        logger.warning(
            "cache lookup of %d entries failed; reading them from storage", len(keys), exc_info=True
        )
        return [None] * len(keys)
    if len(found) != len(keys):
        logger.warning(
            "cache answered %d values for %d keys; reading them from storage", len(found), len(keys)
        )
        return [None] * len(keys)
    return found


def _store(cache: Cache, fresh: list[tuple[CacheKey, Any]]) -> None:
    if not fresh:
        return
    try:
        cache.put_many(fresh)
    except Exception:  # noqa: BLE001 - caching is best effort; the samples are still good
        logger.warning("could not cache %d samples", len(fresh), exc_info=True)


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
