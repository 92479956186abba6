"""Accelerator utilisation (AU), MLPerf Storage's measure, and the search for the most emulated
accelerators a host keeps at or above the threshold.

AU is DLIO's: per rank, the compute time of the measured steps over their wall time, with the
compute time taken as the configured one per step (``steps x compute_s``), not as measured: an
oversleeping ``time.sleep`` on a loaded host must not count as utilisation
(``dlio_benchmark/utils/statscounter.py``, ``compute_metrics_train``: the configured
``computation_time`` summed over the steps after the first, over the block's wall time less the
first step). The job's AU is the mean over ranks (DLIO all-reduces the ranks' AU and divides by
the world size); the worst rank is given beside it, since one slow rank holds the others at
every step's collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def rank_au(steps: int, compute_s: float, wall_s: float) -> float:
    """One rank's AU, a fraction: ``steps`` steps of ``compute_s`` emulated compute in ``wall_s``."""
    if steps < 0 or compute_s < 0:
        raise ValueError(f"steps and compute time must be >= 0, got {steps}, {compute_s}")
    if wall_s <= 0:
        return 0.0
    return min(1.0, steps * compute_s / wall_s)


@dataclass(frozen=True)
class JobAU:
    """The AU of one run of N ranks."""

    ranks: tuple[float, ...]

    @property
    def mean(self) -> float:
        """The job's AU as DLIO reports it: the mean over ranks."""
        return sum(self.ranks) / len(self.ranks) if self.ranks else 0.0

    @property
    def worst(self) -> float:
        return min(self.ranks) if self.ranks else 0.0

    def meets(self, threshold: float) -> bool:
        """DLIO's pass rule: the mean AU at or above the threshold."""
        return self.mean >= threshold


def job_au(rank_summaries: Sequence[Mapping[str, Any]], compute_s: float) -> JobAU:
    """The job's AU from the harness's per-rank summaries (``steps``, ``wall_s``)."""
    if not rank_summaries:
        raise ValueError("job_au needs at least one rank summary")
    return JobAU(tuple(rank_au(int(r["steps"]), compute_s, float(r["wall_s"])) for r in rank_summaries))


@dataclass
class NSearch:
    """The largest N (emulated accelerators, one rank each) whose job AU meets the threshold, in
    ``1 .. max_n``: doubling from 1 until a run fails, then halving the gap between the last
    pass and the first failure. Assumes AU falls as N grows (more ranks share the host).

    ``next_n()`` says which N to run next (None when the answer is known); ``record(n, au)``
    takes its result. Pure bookkeeping, so the runner can interleave several loaders' searches
    and a test can drive it with made-up figures."""

    threshold: float
    max_n: int
    tried: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"--max-accelerators must be >= 1, got {self.max_n}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"the AU threshold must be within (0, 1], got {self.threshold}")

    def _bounds(self) -> tuple[int, int | None]:
        passed = [n for n, au in self.tried.items() if au >= self.threshold]
        failed = [n for n, au in self.tried.items() if au < self.threshold]
        lo = max(passed, default=0)
        hi = min((n for n in failed if n > lo), default=None)
        return lo, hi

    def next_n(self) -> int | None:
        lo, hi = self._bounds()
        if hi is None:
            if lo >= self.max_n:
                return None
            if not self.tried:
                return 1
            return min(self.max_n, max(1, lo * 2))
        if hi - lo <= 1:
            return None
        return (lo + hi) // 2

    def record(self, n: int, au: float) -> None:
        if not 1 <= n <= self.max_n:
            raise ValueError(f"N={n} outside 1..{self.max_n}")
        self.tried[n] = au

    @property
    def done(self) -> bool:
        return self.next_n() is None

    @property
    def result(self) -> int:
        """The largest N that met the threshold (0: not even one accelerator did)."""
        return self._bounds()[0]

    @property
    def capped(self) -> bool:
        """True when the search stopped at ``max_n`` still passing: the host may keep more."""
        return self.tried.get(self.max_n, 0.0) >= self.threshold and self.result == self.max_n
