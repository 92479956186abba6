"""The bench resolves its config once into a frozen plan and opens its data once per process
(issue 23.5): counted by wrapping the opener in this process, and from each spawned rank's log."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re

import pytest

from stallfree.harness import datasets
from stallfree.harness.phases import Probe, Purpose
from stallfree.harness.plan import BenchData, open_data, phase_run, plan_bench
from stallfree.harness.runner import BenchConfig, run_bench
from tests.harness._helpers import tiny_config

SPEC = "synthetic:48:24x16"
WARM = "synthetic:48:32x24"


@pytest.fixture
def opens(monkeypatch):
    """(pid, spec) of every dataset the harness opens in this process."""
    seen: list[tuple[int, str]] = []
    real = datasets.resolve_dataset

    def counting(spec, storage_options=None):
        seen.append((os.getpid(), spec))
        return real(spec, storage_options)

    monkeypatch.setattr(datasets, "resolve_dataset", counting)
    return seen


def test_one_rank_bench_with_analysis_and_tuning_opens_each_dataset_once(opens):
    cfg = tiny_config(
        SPEC,
        ["torch"],
        workers=0,
        warm_from=WARM,
        analyze=True,
        tune=True,
        tune_workers=[0],
        tune_prefetch=[2],
    )
    report = run_bench(cfg)
    assert report["analysis"]["rates"] and report["tune"]["rows"]
    assert report["dataset_samples"] == 48
    assert sorted(opens) == [(os.getpid(), SPEC), (os.getpid(), WARM)]


@pytest.mark.slow  # two spawned ranks, each with its loader workers: started first
def test_two_rank_bench_opens_the_dataset_once_per_process(opens, capfd):
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)  # the spawned ranks log at the launcher's level
    try:
        report = run_bench(tiny_config(SPEC, ["torch"], nproc=2, workers=0, steps=2))
    finally:
        root.setLevel(level)
    assert [r["rank"] for r in report["loaders"]["torch"]["ranks"]] == [0, 1]
    assert opens == [(os.getpid(), SPEC)]  # the launcher: once (the report's length)
    ranks = re.findall(r"rank(\d) stallfree\.harness\.plan: opening dataset (\S+)", capfd.readouterr().err)
    assert sorted(ranks) == [("0", SPEC), ("1", SPEC)]


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BenchConfig(dataset=SPEC).steps = 3  # type: ignore[misc]


def test_the_plan_resolves_each_phase_once():
    cfg = tiny_config(
        SPEC, ["torch", "nosuchloader"], workers=2, prefetch=3, analyze=True, tune=True,
        tune_workers=[0, 1], tune_prefetch=[4], loader_options={"window": 2}, cache_fraction=0.25,
    )  # fmt: skip
    plan = plan_bench(cfg, open_data(cfg))
    assert plan.config is cfg and "nosuchloader" in plan.skipped
    by_label = {run.phase.label: run for run in plan.runs}
    assert list(by_label) == [
        "torch",
        "analyze:synthetic",
        "analyze:prep",
        "analyze:fetch+prep",
        "analyze:train-cached",
        "analyze:train-cold",
        "analyze:whatif",
        "tune:torch:w0",
        "tune:torch:w1:p4",
    ]
    bench, prep = by_label["torch"], by_label["analyze:prep"]
    assert (bench.step, bench.workers, bench.prefetch, bench.cache_fraction) == ("sleep", 2, 3, 0.25)
    assert (prep.step, prep.phase.purpose, prep.cache_fraction) == ("none", Purpose.ANALYZE, 0.25)
    assert by_label["analyze:fetch+prep"].cache_fraction == 0.0  # the phase's own share wins
    assert (by_label["tune:torch:w1:p4"].workers, by_label["tune:torch:w1:p4"].prefetch) == (1, 4)
    assert bench.loader_options == {}  # only stallfree gets the stallfree loader options
    assert plan.analysis[Probe.TRAIN_COLD] == plan.analysis[Probe.TRAIN_COLD]
    assert pickle.loads(pickle.dumps(plan)) == plan  # travels to spawned ranks as one value


def test_stallfree_phases_carry_the_loader_options():
    cfg = tiny_config(SPEC, ["stallfree"], loader_options={"window": 2})
    (run,) = plan_bench(cfg).runs
    assert run.loader_options == {"window": 2} and run == phase_run(cfg, run.phase)


def test_the_analysis_needs_the_data():
    with pytest.raises(ValueError, match="the analysis needs the bench's data"):
        plan_bench(tiny_config(SPEC, ["torch"], analyze=True))


def test_the_probe_is_the_fast_copy_when_there_is_one():
    assert BenchData("slow", "fast").probe == "fast" and BenchData("slow").probe == "slow"
