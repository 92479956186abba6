"""Stall accounting: per step and rank, time blocked on data, in compute and in the collective.

A step is split into three back-to-back phases: ``wait`` (blocked in ``next()`` on the loader),
``compute`` (the training step) and ``sync`` (the all-reduce, where a fast rank waits for a slow
one). The stall share of a rank is wait / wall; the job's stall is the worst rank's (one rank's
stall holds back every rank at the collective, as DS-Analyzer reports it).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without needing numpy; 0.0 when empty."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def process_tree_cpu_seconds() -> float:
    """CPU time of this process and its (loader worker) children, in seconds."""
    try:
        import psutil

        proc = psutil.Process(os.getpid())
        total = sum(proc.cpu_times()[:2])
        for child in proc.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.Error:
                continue
        return total
    except ImportError:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system


@dataclass
class StepRecord:
    """One step of one rank; times are seconds, ``start`` relative to the rank's loop start."""

    start: float
    wait: float
    compute: float
    sync: float
    samples: int

    @property
    def total(self) -> float:
        return self.wait + self.compute + self.sync


@dataclass
class RankMetrics:
    """Collects the phases of every step of one rank; ``summary()`` gives the figures."""

    rank: int
    warmup: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    _t0: float = 0.0
    _cpu0: float = 0.0
    _wall: float = 0.0
    _cpu: float = 0.0

    _tm: float = 0.0

    def start(self) -> None:
        """Mark the start of the loop (call right after a barrier); timeline times count from here."""
        self._t0 = self._tm = time.perf_counter()
        self._cpu0 = process_tree_cpu_seconds()

    def begin_measured(self) -> None:
        """Mark the end of warm-up: CPU use is measured from here."""
        self._tm = time.perf_counter()
        self._cpu0 = process_tree_cpu_seconds()

    def record(self, t_begin: float, t_data: float, t_compute: float, t_end: float, samples: int) -> None:
        """Record one step from four ``perf_counter`` stamps: begin, data in hand, computed, synced."""
        self.steps.append(
            StepRecord(t_begin - self._t0, t_data - t_begin, t_compute - t_data, t_end - t_compute, samples)
        )

    def stop(self) -> None:
        self._wall = time.perf_counter() - self._tm
        self._cpu = process_tree_cpu_seconds() - self._cpu0

    def measured(self) -> list[StepRecord]:
        return self.steps[self.warmup :]

    def summary(self) -> dict[str, Any]:
        """Per-rank figures over the measured steps (warm-up steps excluded)."""
        steps = self.measured()
        if steps:
            first = steps[0].start
            last = steps[-1]
            wall = last.start + last.total - first
        else:
            wall = 0.0
        wait = sum(s.wait for s in steps)
        compute = sum(s.compute for s in steps)
        sync = sum(s.sync for s in steps)
        samples = sum(s.samples for s in steps)
        waits_ms = [s.wait * 1e3 for s in steps]
        totals_ms = [s.total * 1e3 for s in steps]
        return {
            "rank": self.rank,
            "spikes": wait_spikes(waits_ms),
            "steps": len(steps),
            "samples": samples,
            "wall_s": wall,
            "wait_s": wait,
            "compute_s": compute,
            "sync_s": sync,
            "stall_share": wait / wall if wall > 0 else 0.0,
            "samples_per_s": samples / wall if wall > 0 else 0.0,
            "wait_p50_ms": percentile(waits_ms, 50),
            "wait_p99_ms": percentile(waits_ms, 99),
            "step_p50_ms": percentile(totals_ms, 50),
            "step_p99_ms": percentile(totals_ms, 99),
            "cpu_cores": self._cpu / self._wall if self._wall > 0 else 0.0,
        }

    def timeline(self) -> list[list[float]]:
        """Compact per-step rows ``[start, wait, compute, sync]`` (seconds) for the plot."""
        return [
            [round(s.start, 6), round(s.wait, 6), round(s.compute, 6), round(s.sync, 6)] for s in self.steps
        ]


def wait_spikes(waits_ms: Sequence[float], floor_ms: float = 20.0) -> dict[str, Any]:
    """Waits far above the typical one (> 10x the median and > ``floor_ms``): how many, their share
    of all waiting, and the median number of steps between them. Periodic spikes point at a
    boundary the loader does not read ahead across (epoch, shard block, file open)."""
    total = sum(waits_ms)
    limit = max(10 * percentile(waits_ms, 50), floor_ms)
    at = [i for i, w in enumerate(waits_ms) if w > limit]
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    return {
        "count": len(at),
        "share_of_wait": sum(waits_ms[i] for i in at) / total if total > 0 else 0.0,
        "every_steps": percentile(gaps, 50) if gaps else None,
        "threshold_ms": limit,
    }


def job_summary(ranks: Sequence[dict[str, Any]], all_waits_ms: Sequence[float] = ()) -> dict[str, Any]:
    """Combine per-rank summaries: throughput over the slowest rank's wall, stall of the worst rank."""
    if not ranks:
        raise ValueError("job_summary needs at least one rank summary")
    wall = max(r["wall_s"] for r in ranks)
    samples = sum(r["samples"] for r in ranks)
    worst = max(ranks, key=lambda r: r["stall_share"])
    return {
        "ranks": len(ranks),
        "samples": samples,
        "wall_s": wall,
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "stall_share": worst["stall_share"],
        "stall_rank": worst["rank"],
        "mean_stall_share": sum(r["stall_share"] for r in ranks) / len(ranks),
        "wait_p50_ms": percentile(all_waits_ms, 50) if all_waits_ms else worst["wait_p50_ms"],
        "wait_p99_ms": percentile(all_waits_ms, 99) if all_waits_ms else worst["wait_p99_ms"],
        "cpu_cores": sum(r["cpu_cores"] for r in ranks),
    }
