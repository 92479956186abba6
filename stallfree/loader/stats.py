"""Always-on loader counters: data wait vs consumer compute, queue occupancy, stage times.

Updated with a few float additions per batch, so cheap enough to never switch off.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any


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
        self.occupancy_sum = 0
        self.occupancy_n = 0
        self.queue_capacity = 0
        self.stages: dict[str, float] = {}
        self.failures = 0
        self.failed: list[tuple[int, str, str]] = []
        self.cache: dict[str, float] = {}
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
            self.first_batch_s = now - getattr(self, "_iter_started", t0)
        self.batches += 1
        self.samples += samples
        self.last_return = now

    def add_cache(self, delta: Mapping[str, float]) -> None:
        for k, v in delta.items():
            self.cache[k] = self.cache.get(k, 0) + v

    def add_stages(self, timing: Mapping[str, float]) -> None:
        for k, v in timing.items():
            self.stages[k] = self.stages.get(k, 0.0) + float(v)

    def as_dict(self) -> dict[str, Any]:
        elapsed = (time.perf_counter() - self.started) if self.started is not None else 0.0
        busy = self.wait_s + self.compute_s
        cache = dict(self.cache)
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
