"""``stallfree bench --workload``: MLPerf Storage's question on this host, per loader: how many
emulated accelerators stay at or above the workload's AU threshold?

Each emulated accelerator is one rank of the harness (``runner.run_bench``): next batch, a sleep
of the config's compute time, an all-reduce (DLIO has a barrier there). The loaders read the
records without decoding them (``workload_loaders.py``), as DLIO's do. For every loader an
:class:`~stallfree.harness.workload.au.NSearch` picks the N to run; each N is one ``run_bench`` with every
loader that still needs it, side by side in the same ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallfree.harness.config import BenchConfig
from stallfree.harness.workload import data as workload_data
from stallfree.harness.workload.au import JobAU, NSearch, job_au
from stallfree.harness.workload.configs import DEFAULT_SCALE, Workload, workload

logger = logging.getLogger(__name__)

DEFAULT_LOADERS = ("stallfree", "torch", "webdataset", "dali")


@dataclass(frozen=True)
class AUConfig:
    """An AU bench: the workload, where its data lies, what to compare, how far to search."""

    data: str  # the folder the workload's data is written to (and reused from)
    workload: str = "resnet50"
    accelerator: str = "h100"
    scale: int | None = None  # record sizes divided by this; None: DEFAULT_SCALE
    samples: int | None = None  # None: workload_data.DEFAULT_SAMPLES, or enough for max_n ranks
    loaders: tuple[str, ...] = DEFAULT_LOADERS
    max_n: int = 8
    workers: int = 2
    measure_s: float = 2.0  # emulated compute measured per run (steps = this / compute time)
    steps: int | None = None  # overrides measure_s
    warmup: int | None = None
    seed: int = 0
    worker_start: str = "forkserver"
    loader_options: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> Workload:
        wl = workload(self.workload, self.accelerator)
        return wl.scaled(DEFAULT_SCALE[wl.name] if self.scale is None else self.scale)

    def sample_count(self, wl: Workload) -> int:
        """Samples to write: the default, or more when the search's largest N would otherwise
        leave a rank less than two batches per epoch."""
        if self.samples is not None:
            return self.samples
        return max(workload_data.DEFAULT_SAMPLES[wl.name], 2 * self.max_n * wl.batch_size)

    def validate(self) -> None:
        self.resolved()  # names the flag of a bad workload, accelerator or scale
        if self.max_n < 1:
            raise ValueError(f"--max-accelerators must be >= 1, got {self.max_n}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if not self.loaders:
            raise ValueError("--loader needs at least one loader name")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")


def bench_config(cfg: AUConfig, wl: Workload, shards: Path, loaders: list[str], n: int) -> BenchConfig:
    """The harness run of ``loaders`` on ``n`` emulated accelerators."""
    steps = cfg.steps or wl.steps_for(cfg.measure_s)
    warmup = cfg.warmup if cfg.warmup is not None else max(2, steps // 10)
    return BenchConfig(
        dataset=str(shards),
        loaders=list(loaders),
        nproc=n,
        step="sleep",
        step_ms=wl.compute_s * 1e3,
        batch_size=wl.batch_size,
        workers=cfg.workers,
        steps=steps,
        warmup=warmup,
        seed=cfg.seed,
        device="cpu",
        decode="none",
        worker_start=cfg.worker_start,
        loader_options=dict(cfg.loader_options),
        timeline=False,
    )


def _probe_entry(n: int, entry: dict[str, Any], au: JobAU, wl: Workload) -> dict[str, Any]:
    job = entry["job"]
    return {
        "n": n,
        "au": au.mean,
        "au_worst_rank": au.worst,
        "au_ranks": list(au.ranks),
        "meets": au.meets(wl.au_threshold),
        "samples_per_s": job["samples_per_s"],
        "mb_per_s": job["samples_per_s"] * wl.record_bytes / 1e6,
        "cpu_cores": job["cpu_cores"],
    }


Progress = Callable[[str], None]


def run_au_bench(cfg: AUConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Write (or reuse) the data, search each loader's largest N, return the report dict."""
    from stallfree.harness.loaders import loader_available
    from stallfree.harness.runner import run_bench

    cfg.validate()
    say = progress or (lambda line: logger.info("%s", line))
    wl = cfg.resolved()
    started = time.time()
    data = workload_data.prepare(cfg.data, wl, cfg.sample_count(wl), seed=cfg.seed)
    say(f"data: {data.samples} samples, {data.mean_bytes / 1e6:.2f} MB mean, in {data.root}")
    skipped: dict[str, str] = {}
    searches: dict[str, NSearch] = {}
    for name in cfg.loaders:
        reason = loader_available(name)
        if reason:
            skipped[name] = reason
        else:
            searches[name] = NSearch(wl.au_threshold, cfg.max_n)
    probes: dict[str, list[dict[str, Any]]] = {name: [] for name in searches}
    environment: dict[str, Any] = {}
    while True:
        wanted = {name: s.next_n() for name, s in searches.items() if name not in skipped}
        wanted = {name: n for name, n in wanted.items() if n is not None}
        if not wanted:
            break
        n = min(wanted.values())
        names = [name for name, m in wanted.items() if m == n]
        say(f"N={n}: {', '.join(names)}")
        rep = run_bench(bench_config(cfg, wl, data.shards, names, n))
        assert rep is not None  # spawned ranks: the launcher is rank 0
        environment = rep["environment"]
        for name, why in rep["skipped"].items():
            skipped[name] = why
            say(f"  {name}: skipped ({why})")
        for name, entry in rep["loaders"].items():
            au = job_au(entry["ranks"], wl.compute_s)
            searches[name].record(n, au.mean)
            probe = _probe_entry(n, entry, au, wl)
            probes[name].append(probe)
            say(
                f"  {name}: AU {au.mean:.1%} (worst rank {au.worst:.1%}), "
                f"{probe['samples_per_s']:.0f} samples/s, {probe['mb_per_s']:.0f} MB/s"
            )
    loaders = {}
    for name, search in searches.items():
        if name in skipped:
            continue
        best = search.result
        loaders[name] = {
            "max_accelerators": best,
            "capped": search.capped,
            "real_equivalent": best / wl.scale,
            "demand_mb_per_s": best * wl.bytes_per_s / 1e6,
            "probes": sorted(probes[name], key=lambda p: p["n"]),
        }
    return {
        "kind": "au",
        "workload": wl.as_dict(),
        "data": {"root": str(data.root), **data.record},
        "settings": {
            "max_accelerators": cfg.max_n,
            "workers": cfg.workers,
            "steps": cfg.steps or wl.steps_for(cfg.measure_s),
            "loader_options": dict(cfg.loader_options),
        },
        "loaders": loaders,
        "skipped": skipped,
        "environment": environment,
        "elapsed_s": time.time() - started,
    }
