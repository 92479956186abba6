"""Small bench configurations and command lines the harness tests share."""

from __future__ import annotations

from typing import Any

from stallfree.harness.runner import BenchConfig


def tiny_config(dataset: str, loaders: list[str], **overrides: Any) -> BenchConfig:
    """A one-rank, few-step, 16-pixel run on ``dataset``: seconds, not minutes."""
    settings: dict[str, Any] = dict(
        nproc=1,
        step_ms=1,
        batch_size=4,
        workers=1,
        steps=3,
        warmup=1,
        image_size=16,
        timeline=False,
    )
    settings.update(overrides)
    return BenchConfig(dataset=dataset, loaders=loaders, **settings)


def bench_argv(dataset: str, *switches: str, **flags: Any) -> list[str]:
    """``stallfree bench DATASET --flag-name value ... SWITCHES`` from ``flag_name=value`` keywords."""
    argv = ["bench", dataset]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv + list(switches)
