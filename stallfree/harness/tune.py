"""``--tune``: sweep loader workers x prefetch depth on the real step and report the setting that
removes stall at the least CPU (a setting whose worst-rank stall is within the target; the least
stall when none is)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stallfree.harness.config import BenchConfig
from stallfree.harness.phases import Phase


def tune_loader(cfg: BenchConfig) -> str:
    """The loader tuned: the first requested loader that can run here."""
    from stallfree.harness.loaders import loader_available

    for name in cfg.loaders:
        if loader_available(name) is None:
            return name
    raise ValueError(f"--tune: none of the loaders {cfg.loaders} can run here")


def tune_phases(cfg: BenchConfig) -> list[Phase]:
    """One phase per (workers, prefetch); prefetch is moot without workers, so 0 workers runs once."""
    name = tune_loader(cfg)
    phases: list[Phase] = []
    for workers in sorted(set(cfg.tune_workers)):
        if workers < 0:
            raise ValueError(f"--tune-workers must be >= 0, got {workers}")
        for prefetch in sorted(set(cfg.tune_prefetch)) if workers > 0 else [None]:
            if prefetch is not None and prefetch < 1:
                raise ValueError(f"--tune-prefetch must be >= 1, got {prefetch}")
            phases.append(Phase.tuning(name, workers, prefetch))
    return phases


def pick(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The row with the least CPU among those with stall <= target; else the least stall."""
    if not rows:
        raise ValueError("no tuning results to pick from")
    ok = [r for r in rows if r["stall_share"] <= target]
    if ok:
        return min(ok, key=lambda r: (r["cpu_cores"], r["workers"], r["prefetch"] or 0))
    return min(rows, key=lambda r: (r["stall_share"], r["cpu_cores"]))


def summarize(cfg: BenchConfig, results: Mapping[Phase, Any]) -> dict[str, Any]:
    """The sweep's rows (stall, CPU, throughput per setting) and the chosen setting, from the
    ``results`` of the phases :func:`tune_phases` plans."""
    from stallfree.harness.report import phase_entry

    phases = tune_phases(cfg)
    rows = []
    for phase in phases:
        job = phase_entry(results[phase])["job"]
        rows.append(
            {
                "workers": phase.workers,
                "prefetch": phase.prefetch,
                "stall_share": job["stall_share"],
                "cpu_cores": job["cpu_cores"],
                "samples_per_s": job["samples_per_s"],
            }
        )
    best = pick(rows, cfg.tune_target_stall)
    return {
        "loader": phases[0].loader,
        "target_stall": cfg.tune_target_stall,
        "rows": rows,
        "best": best,
        "removes_stall": best["stall_share"] <= cfg.tune_target_stall,
    }
