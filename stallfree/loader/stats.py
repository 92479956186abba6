"""Always-on loader counters: data wait vs consumer compute, queue occupancy, stage times.

Updated with a few float additions per batch, so cheap enough to never switch off.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from stallfree.cache.base import CacheStats

# Cache stats are reported per worker process. Only event counters add up across workers (sent as
# deltas); ratios are recomputed from the summed counters; anything else (entries, used_bytes, ...)
# is a level, kept per worker as last reported.
CACHE_COUNTERS = frozenset(
    (
        *CacheStats.FIELDS,  # the event counters every cache tier keeps
        "node_evictions",
        "get_seconds",
        "put_seconds",
        "read_samples",  # read_through's ReadStats
        "read_cache_hits",
        "read_storage_reads",
    )
)
_RATIO_SUFFIXES = ("_rate", "_ratio", "_fraction", "_latency_ms")


def is_cache_ratio(name: str) -> bool:
    return name.endswith(_RATIO_SUFFIXES)


def cache_ratios(counters: Mapping[str, float]) -> dict[str, float]:
    """hit_rate / read_hit_rate / latencies from summed counters (0.0 when nothing was counted)."""

    def ratio(num: str, den: float, scale: float = 1.0) -> float:
        return scale * counters.get(num, 0) / den if den else 0.0

    out: dict[str, float] = {}
    if "hits" in counters or "misses" in counters:
        out["hit_rate"] = ratio("hits", counters.get("hits", 0) + counters.get("misses", 0))
    if "read_samples" in counters:
        out["read_hit_rate"] = ratio("read_cache_hits", counters["read_samples"])
    for op in ("get", "put"):
        if f"{op}_calls" in counters and f"{op}_seconds" in counters:
            out[f"{op}_latency_ms"] = ratio(f"{op}_seconds", counters[f"{op}_calls"], 1000.0)
    return out


class LoaderStats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.batches = 0
        self.samples = 0
        self.wait_s = 0.0
        self.compute_s = 0.0
        self.first_batch_s: float | None = None
        self.started: float | None = None
        self.last_return: float | None = None
        self._iter_started: float | None = None
        self.occupancy_sum = 0
        self.occupancy_n = 0
        self.queue_capacity = 0
        self.stages: dict[str, float] = {}
        self.failures = 0
        self.failed: list[tuple[int, str, str]] = []
        self.cache: dict[str, float] = {}
        self.cache_levels: dict[int, dict[str, float]] = {}  # worker -> last reported levels
        self.epochs = 0

    def iteration_started(self) -> None:
        now = time.perf_counter()
        if self.started is None:
            self.started = now
        self._iter_started = now
        self.last_return = None

    def before_next(self, occupancy: int) -> float:
        now = time.perf_counter()
        if self.last_return is not None:
            self.compute_s += now - self.last_return
        self.occupancy_sum += occupancy
        self.occupancy_n += 1
        return now

    def after_next(self, t0: float, samples: int) -> None:
        now = time.perf_counter()
        self.wait_s += now - t0
        if self.first_batch_s is None:
            self.first_batch_s = now - (self._iter_started if self._iter_started is not None else t0)
        self.batches += 1
        self.samples += samples
        self.last_return = now

    def add_cache(self, report: Mapping[str, float], worker: int = 0) -> None:
        """A worker's cache report: counter deltas are summed; levels replace its previous ones."""
        levels = self.cache_levels.setdefault(worker, {})
        for k, v in report.items():
            if k in CACHE_COUNTERS:
                self.cache[k] = self.cache.get(k, 0) + v
            elif not is_cache_ratio(k):
                levels[k] = v

    def cache_dict(self) -> dict[str, float] | None:
        """Summed counters, ratios recomputed from them, and levels as the largest any worker
        reported (exact for a cache shared by the workers; a lower bound for per-worker caches)."""
        if not self.cache and not any(self.cache_levels.values()):
            return None
        out: dict[str, float] = dict(self.cache)
        for levels in self.cache_levels.values():
            for k, v in levels.items():
                out[k] = max(out.get(k, v), v)
        out.update(cache_ratios(self.cache))
        return out

    def add_stages(self, timing: Mapping[str, float]) -> None:
        for k, v in timing.items():
            self.stages[k] = self.stages.get(k, 0.0) + float(v)

    def as_dict(self) -> dict[str, Any]:
        elapsed = (time.perf_counter() - self.started) if self.started is not None else 0.0
        busy = self.wait_s + self.compute_s
        cache = self.cache_dict()
        return {
            "batches": self.batches,
            "samples": self.samples,
            "data_wait_s": self.wait_s,
            "compute_s": self.compute_s,
            "wait_fraction": self.wait_s / busy if busy > 0 else 0.0,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            "first_batch_s": self.first_batch_s,
            "queue": {
                "capacity": self.queue_capacity,
                "mean_occupancy": self.occupancy_sum / self.occupancy_n if self.occupancy_n else 0.0,
            },
            "stages_s": dict(self.stages),
            "failures": self.failures,
            "failed_keys": [k for _, k, _ in self.failed[:100]],
            "cache": cache or None,
            "epochs_completed": self.epochs,
        }
