"""A bench resolved once: what it runs (a frozen :class:`BenchPlan`) and what it reads (a
:class:`BenchData`, the datasets opened once per process).

Before, the 36-field config went down into every harness function, and each looked up the field
it needed and the phase's override of it again; the dataset was opened up to four times per
process (the analysis probe, each rank, the warm copy, the report's length). Now
``run_bench`` validates the config, opens the data once (:func:`open_data`) and plans once
(:func:`plan_bench`): each phase becomes a :class:`PhaseRun` with every setting resolved, and a
rank runs those values. Spawned ranks are other processes: each opens the data once itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stallfree.harness import analyze, datasets, tune
from stallfree.harness.config import REMOTE_LOADER, BenchConfig, RemoteSpec
from stallfree.harness.phases import Phase, Probe

logger = logging.getLogger(__name__)

STALLFREE_LOADERS = ("stallfree", REMOTE_LOADER)  # stallfree.DataLoader: --loader-option applies


@dataclass(frozen=True)
class BenchData:
    """The datasets a bench reads, opened once in this process: the dataset under test and the
    same data on fast storage (``warm_from``) to fill warm caches from, when given."""

    dataset: Any
    warm: Any | None = None

    @property
    def probe(self) -> Any:
        """What the analysis probes for sample sizes and memory read speed: the fast copy when
        there is one."""
        return self.warm if self.warm is not None else self.dataset


def open_data(config: BenchConfig) -> BenchData:
    """Open the bench's datasets (once per process: every phase of every loader reads these)."""
    logger.info("opening dataset %s", config.dataset)
    dataset = datasets.resolve_dataset(config.dataset, config.storage_options)
    warm = datasets.resolve_dataset(config.warm_from) if config.warm_from else None
    return BenchData(dataset, warm)


@dataclass(frozen=True)
class PhaseRun:
    """One phase with every setting resolved (the phase's own, else the config's): all a rank
    needs to run it, besides the data and its place in the job."""

    phase: Phase
    step: str  # sleep | busy | model | none
    step_ms: float
    steps: int
    warmup: int
    batch_size: int
    workers: int
    prefetch: int | None
    image_size: int
    seed: int
    decode: str
    device: str
    worker_start: str
    cache_fraction: float  # share of the data warm in memory in front of storage
    slow_delay_s: float
    timeline: bool
    loader_options: Mapping[str, Any] = field(default_factory=dict)  # stallfree's only
    remote: RemoteSpec | None = None  # the stallfree-remote loader's remote workers


def phase_run(config: BenchConfig, phase: Phase) -> PhaseRun:
    """``phase`` with the config's settings where it leaves them open."""

    def own(value: Any, default: Any) -> Any:
        return default if value is None else value

    return PhaseRun(
        phase=phase,
        step=own(phase.step, config.step),
        step_ms=config.step_ms,
        steps=phase.steps or config.steps,
        warmup=config.warmup,
        batch_size=config.batch_size,
        workers=own(phase.workers, config.workers),
        prefetch=own(phase.prefetch, config.prefetch),
        image_size=config.image_size,
        seed=config.seed,
        decode=config.decode,
        device=config.device,
        worker_start=config.worker_start,
        cache_fraction=own(phase.cache_fraction, config.cache_fraction),
        slow_delay_s=config.slow_delay_s,
        timeline=config.timeline,
        loader_options=dict(config.loader_options) if phase.loader in STALLFREE_LOADERS else {},
        remote=config.remote_spec if phase.loader == REMOTE_LOADER else None,
    )


@dataclass(frozen=True)
class BenchPlan:
    """What a bench runs, decided once: the validated config, every phase in run order (the
    requested loaders side by side, then the analysis and tuning phases), the loaders skipped
    and why, and which phase measures each analysis probe."""

    config: BenchConfig
    runs: tuple[PhaseRun, ...]
    bench: tuple[Phase, ...]  # the requested loaders' phases that run here
    skipped: Mapping[str, str]
    analysis: Mapping[Probe, Phase]

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(run.phase for run in self.runs)


def loader_phases(config: BenchConfig) -> tuple[list[Phase], dict[str, str]]:
    """One cold phase per requested loader that can run here, and the reasons for those skipped."""
    from stallfree.harness.loaders import loader_available

    phases, skipped = [], {}
    for name in config.loaders:
        reason = loader_available(name)
        if reason:
            skipped[name] = reason
            logger.warning("skipping loader %s: %s", name, reason)
        else:
            phases.append(Phase(name))
    return phases, skipped


def plan_bench(config: BenchConfig, data: BenchData | None = None) -> BenchPlan:
    """The bench ``config`` describes; ``data`` (needed with ``analyze``) sizes the analysis.
    Raises ValueError for settings that cannot run or when no requested loader can run here."""
    config.validate()
    bench, skipped = loader_phases(config)
    probes: dict[Probe, Phase] = {}
    if config.analyze:
        if data is None:
            raise ValueError("the analysis needs the bench's data (open_data) to size its phases")
        probes = analyze.analysis_phases(config, data.probe)
    extra = [p for p in probes.values() if p not in bench]  # the cold run may be a loader's own
    if config.tune:
        extra += tune.tune_phases(config)
    if not bench and not extra:
        raise ValueError(f"no requested loader can run here: {skipped}")
    return BenchPlan(
        config=config,
        runs=tuple(phase_run(config, p) for p in bench + extra),
        bench=tuple(bench),
        skipped=dict(skipped),
        analysis=probes,
    )
