"""Differential stall analysis (after DS-Analyzer) and a what-if throughput model.

Runs, in the same ranks: (a) the step on synthetic in-memory batches -> ingestion ceiling G;
(b) the loader alone on a subset held in memory -> prep rate P; (c) cold -> fetch+prep rate, from
which the storage bandwidth S follows (the mean of the loader alone and the cold training run when
that run is data-bound, else the loader alone); plus the training step on the cached subset and
cold, whose per-sample time differences give the prep stall and the fetch stall.

What-if for a cache holding a share x of the dataset (D bytes) read at bandwidth C, the rest from
storage at S:  F = D / (D x / C + D (1 - x) / S)  (bytes/s, over mean sample bytes = samples/s),
speed = min(F, P, G) for a loader that fetches and decodes in separate stages; a loader whose
workers fetch then decode each sample in turn adds the times instead: min(1 / (1/F + 1/P), G).
The prediction is checked against a measured run with that cache share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from stallfree.harness.config import BenchConfig
from stallfree.harness.phases import Phase, Probe, Variant

logger = logging.getLogger(__name__)

MAP_STYLE = ("stallfree", "torch")
# Loaders whose workers fetch and decode each sample back to back (stage times add up).
SERIAL_FETCH_PREP = {"torch": True, "stallfree": False}


def analysis_loader(cfg: BenchConfig) -> str:
    """The loader analysed: ``analyze_loader`` or the first map-style loader requested."""
    if cfg.analyze_loader:
        if cfg.analyze_loader not in MAP_STYLE:
            raise ValueError(
                f"--analyze works with map-style loaders ({', '.join(MAP_STYLE)}), not {cfg.analyze_loader!r}"
            )
        return cfg.analyze_loader
    from stallfree.harness.loaders import loader_available

    for name in cfg.loaders:
        if name in MAP_STYLE and loader_available(name) is None:
            return name
    return "torch"


def cached_subset_size(cfg: BenchConfig, n: int) -> int:
    """A subset big enough that every rank and worker has batches to read, small enough to hold."""
    need = cfg.batch_size * cfg.nproc * max(1, cfg.workers) * 4
    return min(n, max(need, 256))


def whatif_share(cfg: BenchConfig, dataset_bytes: float) -> float:
    """The cached share to predict: from ``whatif_cache_bytes`` when given, else the share flag."""
    if cfg.whatif_cache_bytes is not None:
        return max(0.0, min(1.0, cfg.whatif_cache_bytes / max(dataset_bytes, 1.0)))
    return cfg.whatif_cache_fraction


def analysis_phases(cfg: BenchConfig, dataset: Any) -> dict[Probe, Phase]:
    """The phase measuring each probe; ``dataset`` is the one probed (``plan.BenchData.probe``). The cold training
    run is the loader's own bench phase when that one runs with no warm cache."""
    from stallfree.harness.datasets import mean_sample_bytes

    name = analysis_loader(cfg)
    n = len(dataset)
    subset = cached_subset_size(cfg, n)
    x = whatif_share(cfg, mean_sample_bytes(dataset) * n)
    cached, cold = Variant.CACHED, Variant.COLD
    if name in cfg.loaders and cfg.cache_fraction == 0.0:
        train_cold = Phase(name)
    else:
        train_cold = Phase.analysis(Probe.TRAIN_COLD, name, variant=cold, cache_fraction=0.0)
    return {
        Probe.SYNTHETIC: Phase.analysis(Probe.SYNTHETIC, "synthetic"),
        Probe.PREP: Phase.analysis(Probe.PREP, name, variant=cached, step="none", subset=subset),
        Probe.FETCH_PREP: Phase.analysis(
            Probe.FETCH_PREP, name, variant=cold, step="none", cache_fraction=0.0
        ),
        Probe.TRAIN_CACHED: Phase.analysis(Probe.TRAIN_CACHED, name, variant=cached, subset=subset),
        Probe.TRAIN_COLD: train_cold,
        Probe.WHATIF: Phase.analysis(Probe.WHATIF, name, variant=Variant.PARTIAL, cache_fraction=x),
    }


def fetch_rate(fp: float, p: float, serial: bool) -> float:
    """Storage-fetch rate (samples/s) implied by the cold loader rate ``fp`` and prep rate ``p``.

    Serial stages: 1/fp = 1/s + 1/p. Overlapped stages: fp = min(s, p), so s = fp when fp < p, and
    storage is no bottleneck (infinite) otherwise.
    """
    if fp <= 0:
        raise ValueError("the cold loader rate must be positive")
    if serial:
        slack = 1.0 / fp - 1.0 / p
        return 1.0 / slack if slack > 1e-12 else float("inf")
    return fp if fp < 0.97 * p else float("inf")


def whatif_speed(
    *,
    x: float,
    cache_bw: float,
    storage_bw: float,
    sample_bytes: float,
    prep: float,
    ceiling: float,
    serial: bool,
) -> dict[str, float]:
    """Predicted samples/s with a share ``x`` cached: F from the harmonic mix of cache and storage
    bandwidth (bytes/s), then min(F, P, G) (or the serial form). Returns F and the speed."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"cache share must be within [0, 1], got {x}")
    per_byte = x / cache_bw + (1.0 - x) / storage_bw  # seconds per byte; F = D / (D * per_byte)
    fetch = (1.0 / per_byte) / sample_bytes if per_byte > 0 else float("inf")
    loader = 1.0 / (1.0 / fetch + 1.0 / prep) if serial else min(fetch, prep)
    return {"fetch": fetch, "speed": min(loader, ceiling)}


def cache_share_needed(storage: float, prep: float, ceiling: float, serial: bool) -> float | None:
    """Smallest cached share x at which the loader keeps up with the step (cache reads ~free);
    None when no cache suffices (prep-bound)."""
    budget = 1.0 / ceiling - (1.0 / prep if serial else 0.0)  # seconds per sample left for fetch
    if budget <= 0 or (not serial and prep < ceiling):
        return None
    if storage == float("inf"):
        return 0.0
    return max(0.0, min(1.0, 1.0 - storage * budget))


def _probe_cache_bandwidth(dataset: Any, n: int) -> tuple[float, float]:
    """Bytes/s of reading ``n`` samples from an in-memory copy, and their mean payload bytes."""
    from stallfree.harness.datasets import sample_bytes

    held = [dataset[i] for i in range(min(n, len(dataset)))]
    total = sum(sample_bytes(s) for s in held)
    t0 = time.perf_counter()
    for _ in range(3):
        copied = sum(len(bytes(s[k])) for s in held for k in s if isinstance(s[k], (bytes, bytearray)))
    dt = max(time.perf_counter() - t0, 1e-9)
    return 3 * copied / dt, total / max(1, len(held))


def analyze(
    cfg: BenchConfig, results: Mapping[Phase, Any], plan: Mapping[Probe, Phase], dataset: Any
) -> dict[str, Any]:
    """Rates, stall split, what-if prediction vs measurement, and advice, from the ``results`` of
    the ``plan``'s phases (see :func:`analysis_phases`); sample sizes and memory read speed are
    probed on ``dataset`` (``plan.BenchData.probe``)."""
    from stallfree.harness.report import phase_entry

    def job(probe: Probe) -> dict[str, Any]:
        return phase_entry(results[plan[probe]])["job"]

    def speed(probe: Probe) -> float:
        return job(probe)["samples_per_s"]

    name = analysis_loader(cfg)
    serial = SERIAL_FETCH_PREP.get(name, True)
    cache_bw, mean_bytes = _probe_cache_bandwidth(dataset, 64)
    total_bytes = mean_bytes * len(dataset)
    g = speed(Probe.SYNTHETIC)
    p = speed(Probe.PREP)
    fp_alone = speed(Probe.FETCH_PREP)
    t_g, t_p, t_c = (1.0 / speed(k) for k in (Probe.SYNTHETIC, Probe.TRAIN_CACHED, Probe.TRAIN_COLD))
    cold = job(Probe.TRAIN_COLD)
    # The ceiling the data path can reach once fetch is free: the step rate G, less the hand-off
    # cost (IPC, collate, queueing) the cached training run shows; min(F, P, G) with that G.
    g_eff = min(g, 1.0 / t_p)
    # Fetch+prep: two cold measurements of the same storage-bound rate when the cold training run
    # is data-bound (the loader alone, and training); their mean halves the run-to-run noise. When
    # the training run keeps up with the step it says nothing about storage: the loader alone only.
    fp = (fp_alone + 1.0 / t_c) / 2 if 1.0 / t_c < 0.9 * g_eff else fp_alone
    s_rate = fetch_rate(fp, p, serial)
    storage_bw = s_rate * mean_bytes
    model = {"serial": serial, "cache_bw": cache_bw, "sample_bytes": mean_bytes, "prep": p, "ceiling": g_eff}
    x = plan[Probe.WHATIF].cache_fraction
    predicted = whatif_speed(x=x, storage_bw=storage_bw, **model)["speed"]
    measured = speed(Probe.WHATIF)
    result: dict[str, Any] = {
        "loader": name,
        "serial_fetch_prep": serial,
        "dataset_bytes": total_bytes,
        "mean_sample_bytes": mean_bytes,
        "rates": {
            "ingestion_ceiling_G": g,
            "cached_train": 1.0 / t_p,
            "prep_P": p,
            "fetch_plus_prep": fp,
            "fetch_plus_prep_loader_alone": fp_alone,
            "storage_fetch_S": s_rate,
            "storage_bytes_per_s": storage_bw,
            "cache_bytes_per_s": cache_bw,
        },
        "stall": {
            "measured_stall_share": cold["stall_share"],
            "prep_stall_share": max(0.0, (t_p - t_g) / t_c),
            "fetch_stall_share": max(0.0, (t_c - t_p) / t_c),
        },
        "whatif": {
            "cache_share": x,
            "cache_bytes": x * total_bytes,
            "storage_bytes_per_s": storage_bw,
            "predicted_samples_per_s": predicted,
            "measured_samples_per_s": measured,
            "error": abs(predicted - measured) / measured if measured > 0 else None,
        },
    }
    error = result["whatif"]["error"]
    if error is not None and error > 0.10:
        result["whatif"]["note"] = (
            "prediction off by more than 10%: the model assumes storage time scales with bytes read; a "
            "latency-bound store (concurrent requests, per-request cost) or runs crossing epoch/block "
            "boundaries break that"
        )
    if cfg.whatif_storage_bytes_per_s:
        result["whatif_given_storage"] = {
            "cache_share": x,
            "storage_bytes_per_s": cfg.whatif_storage_bytes_per_s,
            "predicted_samples_per_s": whatif_speed(x=x, storage_bw=cfg.whatif_storage_bytes_per_s, **model)[
                "speed"
            ],
        }
    planned = set(plan.values())
    result["phases_samples_per_s"] = {  # in the order the phases ran
        phase.label: phase_entry(r)["job"]["samples_per_s"]
        for phase, r in results.items()
        if phase in planned
    }
    result["advice"] = advice(result, serial)
    return result


def advice(result: dict[str, Any], serial: bool) -> list[str]:
    """Plain sentences on what would remove the stall measured."""
    rates, stall = result["rates"], result["stall"]
    tips = []
    if stall["fetch_stall_share"] > 0.05:
        x = cache_share_needed(
            rates["storage_fetch_S"], rates["prep_P"], rates["ingestion_ceiling_G"], serial
        )
        if x is None:
            tips.append("fetch stall: no cache size removes it while prep is the bottleneck; fix prep first")
        else:
            tips.append(
                f"fetch stall {100 * stall['fetch_stall_share']:.0f}%: cache {100 * x:.0f}% of the dataset "
                f"({x * result['dataset_bytes'] / 1e9:.2f} GB) or raise fetch concurrency"
            )
    if stall["prep_stall_share"] > 0.05 and rates["prep_P"] >= rates["ingestion_ceiling_G"]:
        tips.append(
            f"hand-off stall {100 * stall['prep_stall_share']:.0f}%: the loader outruns the step "
            f"({rates['prep_P']:.0f} vs {rates['ingestion_ceiling_G']:.0f} samples/s) but batches arrive late "
            f"(IPC/collate per batch, too shallow a prefetch): deepen prefetch or move the hand-off off the step"
        )
    elif stall["prep_stall_share"] > 0.05:
        need = rates["ingestion_ceiling_G"] / max(rates["prep_P"], 1e-9)
        tips.append(
            f"prep stall {100 * stall['prep_stall_share']:.0f}%: decode/augment is {need:.1f}x too slow for the step; "
            f"add CPU workers/cores or decode on the GPU (stallfree ImageDecode, DALI)"
        )
    if not tips:
        tips.append("no material stall: the loader keeps up with the step")
    return tips
