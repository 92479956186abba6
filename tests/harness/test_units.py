"""Harness pieces without processes: stall arithmetic, the what-if model, tuning pick, recipe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stallfree.errors import SampleDecodeError
from stallfree.gpu_decode.augment import random_resized_crop
from stallfree.harness import analyze, tune
from stallfree.harness.datasets import (
    PartialCache,
    SlowDataset,
    SyntheticImages,
    resolve_dataset,
    sample_bytes,
)
from stallfree.harness.metrics import RankMetrics, job_summary, percentile
from stallfree.harness.runner import BenchConfig
from stallfree.harness.transforms import PILRecipe, label_of


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_rank_metrics_split_steps_into_phases_and_skip_warmup():
    m = RankMetrics(rank=1, warmup=1)
    m._t0 = 100.0
    # (begin, data in hand, computed, synced), samples
    m.record(100.0, 100.5, 100.6, 100.6, 4)  # warm-up: slow first batch, excluded
    m.record(100.6, 100.61, 100.71, 100.72, 4)
    m.record(100.72, 100.77, 100.87, 100.88, 4)
    s = m.summary()
    assert s["rank"] == 1 and s["steps"] == 2 and s["samples"] == 8
    assert s["wait_s"] == pytest.approx(0.06)
    assert s["compute_s"] == pytest.approx(0.20)
    assert s["sync_s"] == pytest.approx(0.02)
    assert s["wall_s"] == pytest.approx(0.28)
    assert s["stall_share"] == pytest.approx(0.06 / 0.28)
    assert s["samples_per_s"] == pytest.approx(8 / 0.28)
    assert m.timeline()[0] == [0.0, 0.5, 0.1, 0.0]


def test_job_summary_reports_the_worst_rank():
    ranks = [
        {
            "rank": 0,
            "wall_s": 2.0,
            "samples": 100,
            "stall_share": 0.1,
            "wait_p50_ms": 1,
            "wait_p99_ms": 2,
            "cpu_cores": 0.5,
        },
        {
            "rank": 1,
            "wall_s": 2.5,
            "samples": 100,
            "stall_share": 0.3,
            "wait_p50_ms": 3,
            "wait_p99_ms": 9,
            "cpu_cores": 0.7,
        },
    ]
    job = job_summary(ranks)
    assert job["stall_share"] == 0.3 and job["stall_rank"] == 1
    assert job["samples_per_s"] == pytest.approx(200 / 2.5)
    assert job["mean_stall_share"] == pytest.approx(0.2)
    assert job["cpu_cores"] == pytest.approx(1.2)
    with pytest.raises(ValueError, match="at least one rank"):
        job_summary([])


def test_whatif_formula_is_the_harmonic_mix_capped_by_prep_and_ceiling():
    # D bytes; x cached at C, the rest from storage at S: F = D / (D x / C + D (1 - x) / S)
    x, c, s, b = 0.5, 1e9, 1e6, 1e4
    f_bytes = 1 / (x / c + (1 - x) / s)
    out = analyze.whatif_speed(
        x=x, cache_bw=c, storage_bw=s, sample_bytes=b, prep=1e6, ceiling=1e6, serial=False
    )
    assert out["fetch"] == pytest.approx(f_bytes / b)
    assert out["speed"] == pytest.approx(f_bytes / b)
    capped = analyze.whatif_speed(
        x=x, cache_bw=c, storage_bw=s, sample_bytes=b, prep=50.0, ceiling=1e6, serial=False
    )
    assert capped["speed"] == 50.0
    ceiling = analyze.whatif_speed(
        x=1.0, cache_bw=c, storage_bw=s, sample_bytes=b, prep=1e6, ceiling=30.0, serial=False
    )
    assert ceiling["speed"] == 30.0
    serial = analyze.whatif_speed(
        x=0.0, cache_bw=c, storage_bw=s, sample_bytes=b, prep=100.0, ceiling=1e6, serial=True
    )
    assert serial["speed"] == pytest.approx(1 / (1 / 100.0 + 1 / 100.0))
    with pytest.raises(ValueError, match="within"):
        analyze.whatif_speed(x=1.5, cache_bw=c, storage_bw=s, sample_bytes=b, prep=1, ceiling=1, serial=False)


def test_fetch_rate_inverts_the_stage_model():
    assert analyze.fetch_rate(50.0, 100.0, serial=True) == pytest.approx(100.0)
    assert analyze.fetch_rate(40.0, 100.0, serial=False) == 40.0
    assert analyze.fetch_rate(100.0, 100.0, serial=False) == float("inf")
    with pytest.raises(ValueError, match="positive"):
        analyze.fetch_rate(0.0, 1.0, serial=True)


def test_cache_share_needed():
    # storage gives 50/s, step wants 100/s, prep free (overlapped): half must come from cache
    assert analyze.cache_share_needed(50.0, 1e9, 100.0, serial=False) == pytest.approx(0.5)
    assert analyze.cache_share_needed(float("inf"), 1e9, 100.0, serial=False) == 0.0
    assert analyze.cache_share_needed(50.0, 80.0, 100.0, serial=False) is None  # prep-bound
    assert analyze.cache_share_needed(50.0, 80.0, 100.0, serial=True) is None


def test_tune_picks_least_cpu_among_stall_free_else_least_stall():
    rows = [
        {"workers": 1, "prefetch": 2, "stall_share": 0.20, "cpu_cores": 0.5},
        {"workers": 2, "prefetch": 2, "stall_share": 0.01, "cpu_cores": 0.9},
        {"workers": 4, "prefetch": 2, "stall_share": 0.00, "cpu_cores": 1.4},
    ]
    assert tune.pick(rows, 0.02)["workers"] == 2
    assert tune.pick(rows, 0.0)["workers"] == 4
    assert tune.pick(rows[:1], 0.02)["workers"] == 1
    cfg = BenchConfig(dataset="synthetic:8", loaders=["torch"], tune_workers=[0, 2], tune_prefetch=[2, 4])
    assert [p.label for p in tune.tune_phases(cfg)] == [
        "tune:torch:w0",
        "tune:torch:w2:p2",
        "tune:torch:w2:p4",
    ]


def test_random_resized_crop_box_stays_inside_the_image():
    rng = np.random.default_rng(0)
    for w, h in [(500, 375), (32, 24), (1, 1), (1000, 10)]:
        for _ in range(50):
            left, top, cw, ch = random_resized_crop(w, h, rng)
            assert 0 <= left and 0 <= top and cw > 0 and ch > 0
            assert left + cw <= w and top + ch <= h


def test_pil_recipe_decodes_crops_and_labels_and_refuses_broken_samples():
    from stallfree.testing.images import jpeg_bytes

    (jpeg,) = jpeg_bytes(1, seed=0)
    recipe = PILRecipe(16, seed=0)
    image, label = recipe({"__key__": "a", "jpg": jpeg, "cls": b"7"})
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32 and label == 7
    with pytest.raises(SampleDecodeError, match="cannot decode jpg: .*truncated") as exc:
        recipe({"__key__": "b", "jpg": jpeg[: len(jpeg) // 2]})
    assert exc.value.key == "b"
    with pytest.raises(SampleDecodeError, match=r"cannot decode png: .*\(sample 'd'\)"):
        recipe({"__key__": "d", "png": b"not an image"})
    with pytest.raises(SampleDecodeError) as missing:
        recipe({"__key__": "c", "txt": b"no image", "cls": b"1"})
    assert str(missing.value) == (
        "no image field (looked for jpg, jpeg, png, webp, bmp, ppm, pgm, tif, tiff, img, image; it has cls, txt) (sample 'c')"
    )
    assert missing.value.key == "c"


def test_label_of_reads_tar_and_arrow_forms():
    assert label_of({"cls": b"17"}) == 17
    assert label_of({"cls": 3}) == 3
    assert label_of({}) == 0


def test_partial_cache_serves_the_first_share_from_memory():
    base = SyntheticImages(10, size=(16, 12))
    cache = PartialCache(base, 0.3)
    assert cache.cached == 3 and len(cache) == 10
    assert sorted(cache._memory) == [3, 6, 9]  # spread evenly, not the first three
    assert cache.cached_bytes == sum(sample_bytes(base[i]) for i in (3, 6, 9))
    assert [cache[i]["__key__"] for i in range(10)] == [f"{i:08d}" for i in range(10)]
    assert [s["__key__"] for s in cache.get_many([9, 0, 3])] == ["00000009", "00000000", "00000003"]
    assert cache[6] is cache._memory[6]
    assert PartialCache(base, 1.0).cached == 10 and PartialCache(base, 0.0).cached == 0
    assert cache.fingerprint == base.fingerprint
    with pytest.raises(AttributeError):
        cache.shard_sizes  # noqa: B018 - the synthetic base has none, so neither does the cache
    with pytest.raises(ValueError, match="within"):
        PartialCache(base, 1.5)


def test_synthetic_and_slow_datasets():
    ds = SlowDataset(SyntheticImages(4, size=(16, 12), classes=3), 0.0)
    assert len(ds) == 4 and ds[3]["cls"] == b"0" and ds[2]["jpg"][:2] == b"\xff\xd8"
    with pytest.raises(IndexError):
        SyntheticImages(4)[4]
    with pytest.raises(ValueError, match="positive"):
        SyntheticImages(0)


def test_resolve_dataset_rejects_bad_synthetic_specs():
    assert len(resolve_dataset("synthetic:5:16x12")) == 5
    with pytest.raises(ValueError, match="synthetic:N"):
        resolve_dataset("synthetic:many")
    with pytest.raises(ValueError, match="WxH"):
        resolve_dataset("synthetic:5:16")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("nproc", 0, "--nproc"),
        ("steps", 0, "--steps"),
        ("batch_size", 0, "--batch-size"),
        ("workers", -1, "--workers"),
        ("step", "gpu", "--step"),
        ("loaders", [], "--loader"),
        ("step_ms", -1.0, "--step-ms"),
        ("cache_fraction", 2.0, "fractions"),
    ],
)
def test_config_validation_names_the_flag(field, value, message):
    cfg = BenchConfig(dataset="synthetic:8", **{field: value})
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_cli_reads_torchrun_world_from_env(monkeypatch):
    from stallfree.cli import build_parser
    from stallfree.cli.bench import config_from_args

    args = build_parser().parse_args(
        [
            "bench",
            "synthetic:8",
            "--nproc",
            "4",
            "--loader",
            "torch, stallfree",
            "--whatif-cache-gb",
            "2",
            "--loader-option",
            "window=1",
            "--loader-option",
            "autotune=true",
            "--loader-option",
            "order=block",
            "--whatif-storage-mbps",
            "50",
            "--device",
            "cpu",
        ]
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = config_from_args(args)
    assert cfg.rank is None and cfg.nproc == 4 and cfg.loaders == ["torch", "stallfree"]
    assert cfg.whatif_cache_bytes == 2e9 and cfg.whatif_storage_bytes_per_s == 50e6
    assert cfg.loader_options == {"window": 1, "autotune": True, "order": "block"}
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = config_from_args(args)
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.local_size, cfg.nproc) == (3, 8, 1, 2, 8)
    assert cfg.init_method == "env://"


def test_wait_spikes_finds_periodic_long_waits():
    from stallfree.harness.metrics import wait_spikes

    waits = [0.2] * 48
    for i in (7, 23, 39):
        waits[i] = 400.0
    spikes = wait_spikes(waits)
    assert spikes["count"] == 3 and spikes["every_steps"] == 16
    assert spikes["share_of_wait"] == pytest.approx(1200 / (1200 + 45 * 0.2))
    assert wait_spikes([1.0] * 10) == {
        "count": 0,
        "share_of_wait": 0.0,
        "every_steps": None,
        "threshold_ms": 20.0,
    }
    assert wait_spikes([])["count"] == 0


def test_format_table_explains_spikes_stages_epochs_and_skips():
    from stallfree.harness.report import format_table

    rank = {
        "rank": 0,
        "samples_per_s": 100.0,
        "stall_share": 0.3,
        "wait_p50_ms": 0.2,
        "wait_p99_ms": 400.0,
        "step_p50_ms": 41.0,
        "cpu_cores": 0.3,
        "spikes": {"count": 2, "share_of_wait": 0.99, "every_steps": 16, "threshold_ms": 20.0},
    }
    job = {
        "samples_per_s": 100.0,
        "stall_share": 0.3,
        "wait_p50_ms": 0.2,
        "wait_p99_ms": 400.0,
        "cpu_cores": 0.3,
    }
    report = {
        "config": {
            "nproc": 1,
            "rank": None,
            "step": "sleep",
            "step_ms": 40.0,
            "batch_size": 16,
            "workers": 2,
            "steps": 40,
            "warmup": 8,
        },
        "loaders": {
            "stallfree": {
                "job": job,
                "ranks": [rank],
                "stats": {"batches": 10, "stages_s": {"fetch_s": 1.0, "map_s": 0.5}},
            }
        },
        "skipped": {"dali": "nvidia.dali is not installed"},
        "dataset_samples": 512,
    }
    text = format_table(report)
    assert "stallfree   job      100.0     30.0" in text
    assert "99% of rank 0's wait is 2 spike(s) over 20 ms, about every 16 steps" in text
    assert "stallfree stages, ms per batch (rank 0, loader's own counters): fetch 100.0, map 50.0" in text
    assert "an epoch is 32 steps (512 samples), so the run crosses 1 epoch boundary" in text
    assert "skipped dali: nvidia.dali is not installed" in text
    assert "1 ranks, step sleep 40 ms, batch 16, workers 2, 40 steps (+8 warm-up)" in text


def test_torch_style_loaders_get_the_same_worker_keywords():
    from stallfree.harness.loaders import LoaderSettings

    assert LoaderSettings(dataset=None, workers=0).torch_loader_kwargs() == {"pin_memory": False}
    kwargs = LoaderSettings(
        dataset=None, workers=2, prefetch=4, device="cuda:0", worker_start="spawn"
    ).torch_loader_kwargs()
    assert kwargs.pop("multiprocessing_context").get_start_method() == "spawn"
    assert kwargs == {"pin_memory": True, "persistent_workers": True, "prefetch_factor": 4}


def test_error_line_is_the_message_or_the_wrapped_workers_own_error():
    from stallfree.errors import CorruptShardError
    from stallfree.harness.errors import error_line

    assert (
        error_line(SampleDecodeError("cannot decode jpg: bad", key="k"))
        == "cannot decode jpg: bad (sample 'k')"
    )
    wrapped = CorruptShardError(
        "Caught CorruptShardError in DataLoader worker process 0.\n"
        "Original Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "    raise CorruptShardError(\n"
        "stallfree.errors.CorruptShardError: shard is truncated (shard a.tar, byte offset 9)\n"
    )
    assert error_line(wrapped) == "shard is truncated (shard a.tar, byte offset 9)"
    assert error_line(RuntimeError("Caught it.\nTraceback:\nValueError: x")) == "ValueError: x"
    assert error_line(RuntimeError("")) == "RuntimeError"


def test_phases_are_typed_values_looked_up_by_what_they_are():
    from stallfree.harness.phases import Phase, Probe, Purpose, Variant

    ds = resolve_dataset("synthetic:64:32x24")
    cfg = BenchConfig(dataset="synthetic:64:32x24", loaders=["torch"], batch_size=4, analyze=True)
    plan = analyze.analysis_phases(cfg, ds)
    assert list(plan) == list(Probe)
    # no warm cache: the loader's own bench phase is the cold training run (run once)
    assert plan[Probe.TRAIN_COLD] == Phase("torch") and plan[Probe.TRAIN_COLD].purpose is Purpose.BENCH
    assert [p.label for p in plan.values()] == [
        "analyze:synthetic",
        "analyze:prep",
        "analyze:fetch+prep",
        "analyze:train-cached",
        "torch",
        "analyze:whatif",
    ]
    assert plan[Probe.PREP].variant is Variant.CACHED and plan[Probe.PREP].step == "none"
    assert plan[Probe.WHATIF].variant is Variant.PARTIAL and plan[Probe.WHATIF].cache_fraction == 0.5
    warm = BenchConfig(dataset="synthetic:64:32x24", loaders=["torch"], cache_fraction=0.25, analyze=True)
    cold = analyze.analysis_phases(warm, ds)[Probe.TRAIN_COLD]
    assert (cold.label, cold.purpose, cold.cache_fraction) == ("analyze:train-cold", Purpose.ANALYZE, 0.0)
    assert Phase.tuning("torch", 2, 4).as_dict() == {
        "label": "tune:torch:w2:p4",
        "loader": "torch",
        "variant": "cold",
        "step": None,
        "steps": None,
        "workers": 2,
        "prefetch": 4,
        "cache_fraction": None,
        "subset": None,
    }
    with pytest.raises(ValueError, match="needs a probe"):
        Phase("torch", Purpose.ANALYZE)
    with pytest.raises(ValueError, match="needs a probe"):
        Phase("torch", probe=Probe.PREP)
