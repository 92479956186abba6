"""Phases: the measured runs of a bench, as typed values.

A phase is identified by what it is (a frozen, hashable dataclass), not by a string: the runner,
the analysis and the tuner look results up by the phase itself. ``label`` is only its display
name (the progress bar, logs, and the report's JSON keys).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Purpose(enum.Enum):
    """Why a phase runs."""

    BENCH = "bench"  # one requested loader, side by side with the others
    ANALYZE = "analyze"  # one measurement of the differential analysis (--analyze)
    TUNE = "tune"  # one setting of the workers x prefetch sweep (--tune)


class Probe(enum.Enum):
    """The measurements of the differential analysis (see analyze.py)."""

    SYNTHETIC = "synthetic"  # the step on in-memory batches: the ingestion ceiling
    PREP = "prep"  # the loader alone on a subset held in memory
    FETCH_PREP = "fetch+prep"  # the loader alone, cold
    TRAIN_CACHED = "train-cached"  # training on the cached subset
    TRAIN_COLD = "train-cold"  # training, cold
    WHATIF = "whatif"  # training with a share of the data cached, to check the prediction


class Variant(enum.Enum):
    """The dataset a phase reads."""

    COLD = "cold"  # storage (behind the config's warm cache share, if any)
    CACHED = "cached"  # a subset held in memory
    PARTIAL = "partial"  # the phase's cache_fraction of the data warm in memory


@dataclass(frozen=True)
class Phase:
    """One measured run inside the ranks; fields left None take the config's value."""

    loader: str
    purpose: Purpose = Purpose.BENCH
    probe: Probe | None = None  # which measurement, for Purpose.ANALYZE only
    variant: Variant = Variant.COLD
    step: str | None = None
    steps: int | None = None
    workers: int | None = None
    prefetch: int | None = None
    cache_fraction: float | None = None
    subset: int | None = None

    def __post_init__(self) -> None:
        if (self.probe is not None) != (self.purpose is Purpose.ANALYZE):
            raise ValueError(f"an analysis phase needs a probe and no other phase has one: {self!r}")

    @classmethod
    def analysis(cls, probe: Probe, loader: str, **settings: Any) -> Phase:
        return cls(loader, Purpose.ANALYZE, probe, **settings)

    @classmethod
    def tuning(cls, loader: str, workers: int, prefetch: int | None) -> Phase:
        return cls(loader, Purpose.TUNE, workers=workers, prefetch=prefetch)

    @property
    def label(self) -> str:
        """Display name: the loader, ``analyze:<probe>`` or ``tune:<loader>:w<W>[:p<P>]``."""
        if self.probe is not None:
            return f"analyze:{self.probe.value}"
        if self.purpose is Purpose.TUNE:
            return f"tune:{self.loader}:w{self.workers}" + (f":p{self.prefetch}" if self.prefetch else "")
        return self.loader

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe form, as the report writes it."""
        return {
            "label": self.label,
            "loader": self.loader,
            "variant": self.variant.value,
            "step": self.step,
            "steps": self.steps,
            "workers": self.workers,
            "prefetch": self.prefetch,
            "cache_fraction": self.cache_fraction,
            "subset": self.subset,
        }
