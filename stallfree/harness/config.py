"""What a bench is asked to do: the settings the CLI fills from its flags (and torchrun's env).

Frozen: it is made once (by the CLI, or a caller of ``run_bench``) and planned once
(``plan.plan_bench``); nothing downstream changes it. Its own module so the phase planners
(analyze.py, tune.py, plan.py) and the launcher (runner.py) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BenchConfig:
    """Everything a bench needs; the CLI fills it from flags (and torchrun's env, when present)."""

    dataset: str
    loaders: list[str] = field(default_factory=lambda: ["stallfree", "torch"])
    nproc: int = 2
    step: str = "sleep"  # sleep | busy | model | none
    step_ms: float = 20.0
    batch_size: int = 32
    workers: int = 2
    prefetch: int | None = None
    steps: int = 50
    warmup: int = 3
    image_size: int = 64
    seed: int = 0
    device: str = "cpu"
    decode: str = "auto"
    worker_start: str = "forkserver"  # fork | forkserver | spawn, for every loader's workers
    storage_options: dict[str, Any] = field(default_factory=dict)
    loader_options: dict[str, Any] = field(default_factory=dict)
    slow_delay_s: float = 0.0  # sleep per sample in __getitem__ (an injected, known stall)
    cache_fraction: float = 0.0  # share of the dataset held warm in memory in front of storage
    warm_from: str | None = None  # the same dataset on fast storage, to fill warm caches from
    timeline: bool = True
    progress: bool = False  # a tqdm bar on stderr (rank 0)
    # Set when running inside an existing job (torchrun): this process's rank and the rendezvous.
    rank: int | None = None
    world_size: int | None = None
    local_rank: int = 0
    local_size: int | None = None
    init_method: str | None = None
    # Analysis and tuning (see analyze.py / tune.py).
    analyze: bool = False
    analyze_loader: str | None = None
    whatif_cache_fraction: float = 0.5
    whatif_cache_bytes: float | None = None  # overrides whatif_cache_fraction when set
    whatif_storage_bytes_per_s: float | None = None
    tune: bool = False
    tune_workers: list[int] = field(default_factory=lambda: [1, 2, 4])
    tune_prefetch: list[int] = field(default_factory=lambda: [2, 4])
    tune_target_stall: float = 0.02

    def validate(self) -> None:
        """Reject settings that cannot run, with a message naming the flag."""
        if self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {self.steps}, {self.warmup}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if self.step_ms < 0:
            raise ValueError(f"--step-ms must be >= 0, got {self.step_ms}")
        if self.worker_start not in ("fork", "forkserver", "spawn"):
            raise ValueError(f"--worker-start must be fork, forkserver or spawn, got {self.worker_start!r}")
        if self.step not in ("sleep", "busy", "model", "none"):
            raise ValueError(f"--step must be sleep, busy, model or none, got {self.step!r}")
        if not self.loaders:
            raise ValueError("--loader needs at least one loader name")
        if not 0.0 <= self.cache_fraction <= 1.0 or not 0.0 <= self.whatif_cache_fraction <= 1.0:
            raise ValueError("cache fractions must be within [0, 1]")
