"""What a bench is asked to do: the settings the CLI fills from its flags (and torchrun's env).

Frozen: it is made once (by the CLI, or a caller of ``run_bench``) and planned once
(``plan.plan_bench``); nothing downstream changes it. Its own module so the phase planners
(analyze.py, tune.py, plan.py) and the launcher (runner.py) share it without importing each other.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import stallfree

REMOTE_LOADER = "stallfree-remote"  # stallfree.DataLoader plus remote=RayWorkers(...) (harness/loaders.py)


@dataclass(frozen=True)
class RemoteSpec:
    """The remote workers of the ``stallfree-remote`` loader: ``workers`` Ray actors per rank of
    ``cpus`` CPUs each, on the nodes carrying the custom ``resource`` (None: any node but the
    trainer's), on the cluster at ``address`` (None: the Ray this process is connected to, else
    ``auto``). The values ``stallfree.RayWorkers`` takes, as flags can give them."""

    address: str | None = None
    workers: int = 2
    cpus: float = 1.0
    resource: str | None = None

    def validate(self) -> None:
        """Reject values RayWorkers would refuse inside a rank, naming the flag, before any runs."""
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"--remote-workers must be an integer >= 1, got {self.workers!r}")
        if not self.cpus > 0:
            raise ValueError(f"--remote-cpus must be > 0, got {self.cpus!r}")
        if self.resource is not None and not self.resource.strip():
            raise ValueError("--remote-resource must name a Ray resource, got an empty name")

    def ray_workers(self) -> stallfree.RayWorkers:
        """A new ``stallfree.RayWorkers`` (one per loader: it owns its actors)."""
        import stallfree

        return stallfree.RayWorkers(
            self.workers,
            cpus_per_worker=self.cpus,
            resources={self.resource: self.cpus} if self.resource else None,
            address=self.address,
        )


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
    # The remote workers of --loader stallfree-remote (None there: RemoteSpec's defaults).
    remote: RemoteSpec | None = None

    @property
    def remote_spec(self) -> RemoteSpec:
        """The remote workers the ``stallfree-remote`` loader gets."""
        return self.remote if self.remote is not None else RemoteSpec()

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
        if self.remote is not None and REMOTE_LOADER not in self.loaders:
            raise ValueError(
                f"--ray-address and --remote-* set the remote workers of --loader {REMOTE_LOADER}; "
                f"add it to --loader (e.g. --loader stallfree,{REMOTE_LOADER})"
            )
        if REMOTE_LOADER in self.loaders:
            self.remote_spec.validate()
            if importlib.util.find_spec("ray") is None:  # before any rank starts, not inside one
                from stallfree.extras import MissingExtra

                raise MissingExtra("ray", "ray", f"stallfree bench --loader {REMOTE_LOADER}")
