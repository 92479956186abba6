"""Stall harness benchmarks: stallfree beside torch (and webdataset) in the same run, same ranks,
same data, same per-sample work, same emulated GPU step.

(a) local shards, step rate set so every loader's capacity is >= 1.2x the step rate:
    stallfree's stall share <= 2%, torch measured beside it.
(b) shards behind a loopback HTTP endpoint adding 20 ms per request: stallfree's stall <= 5%
    (it knows the order and prefetches), torch and webdataset measured beside it.
(c) --analyze on shards behind a bandwidth-capped endpoint: the what-if prediction for a 50%
    cache within 10% of the measured run with that cache.

Run: .venv/bin/python benchmarks/bench_stall.py [--only a,b,c] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from stallfree.harness.fixtures import write_jpeg_shards
from stallfree.harness.report import format_analysis, format_table
from stallfree.harness.runner import BenchConfig, run_bench
from stallfree.testing.httpserve import serve_directory

NPROC = 2
BATCH = 16
WORKERS = 2
IMAGE = 32
# Enough samples that a run stays inside one epoch (a fresh epoch restarts every loader's
# read-ahead, which short epochs would turn into most of the measured stall).
SAMPLES = 2048


def _cfg(dataset: str, loaders: list[str], **kw) -> BenchConfig:
    base = dict(
        dataset=dataset,
        loaders=loaders,
        nproc=NPROC,
        step="sleep",
        batch_size=BATCH,
        workers=WORKERS,
        image_size=IMAGE,
        steps=40,
        warmup=8,
        timeline=False,
        decode="recipe",
        prefetch=4,
    )
    base.update(kw)
    return BenchConfig(**base)


def bench_a(root: Path, step_ms: float = 80.0) -> dict:
    """Capacity probe (loaders alone, no step), then an 80 ms step (an emulated GPU step) for both
    loaders; the step is lengthened if a loader's capacity would fall under 1.2x its rate."""
    probe = run_bench(_cfg(str(root), ["stallfree", "torch"], step="none", steps=30))
    capacity = {k: v["job"]["samples_per_s"] for k, v in probe["loaders"].items()}
    step_ms = max(step_ms, 1e3 * BATCH * NPROC * 1.2 / min(capacity.values()))
    step_rate = 1e3 * BATCH * NPROC / step_ms  # job samples/s the step consumes
    rep = run_bench(_cfg(str(root), ["stallfree", "torch"], step_ms=step_ms))
    print(format_table(rep, per_rank=False))
    stall = {k: v["job"]["stall_share"] for k, v in rep["loaders"].items()}
    return {
        "capacity_samples_per_s": capacity,
        "step_ms": step_ms,
        "capacity_over_step_rate": {k: c / step_rate for k, c in capacity.items()},
        "stall_share": stall,
        "wait_p99_ms": {k: v["job"]["wait_p99_ms"] for k, v in rep["loaders"].items()},
        "samples_per_s": {k: v["job"]["samples_per_s"] for k, v in rep["loaders"].items()},
        "pass": stall["stallfree"] <= 0.02,
    }


def bench_b(root: Path, step_ms: float = 40.0, latency_s: float = 0.020) -> dict:
    """stallfree (defaults), torch and webdataset side by side; then stallfree with ``window=1``
    (one shard per block) on the same server, for reference (not part of the criterion)."""
    with serve_directory(root, latency_s=latency_s) as server:
        rep = run_bench(_cfg(server.url, ["stallfree", "torch", "webdataset"], step_ms=step_ms))
        requests = server.stats.requests
        idx_requests = sum(v for k, v in server.stats.paths.items() if k.endswith(".idx"))
        alt = run_bench(_cfg(server.url, ["stallfree"], step_ms=step_ms, loader_options={"window": 1}))
    print(format_table(rep, per_rank=False))
    print(format_table(alt, per_rank=False).replace("stallfree ", "stallfree(window=1) ", 1))
    stall = {k: v["job"]["stall_share"] for k, v in rep["loaders"].items()}
    return {
        "latency_ms": latency_s * 1e3,
        "step_ms": step_ms,
        "stall_share": stall,
        "samples_per_s": {k: v["job"]["samples_per_s"] for k, v in rep["loaders"].items()},
        "spikes": {
            k: max(v["ranks"], key=lambda r: r["stall_share"])["spikes"] for k, v in rep["loaders"].items()
        },
        "stallfree_window1_stall_share": alt["loaders"]["stallfree"]["job"]["stall_share"],
        "http_requests": requests,
        "idx_requests": idx_requests,
        "skipped": rep["skipped"],
        "pass": stall["stallfree"] <= 0.05,
    }


def bench_c(root: Path, loader: str, bandwidth: float, latency_s: float, step_ms: float) -> dict:
    """--analyze against storage with an aggregate bandwidth cap (the model's S); caches are
    warmed from the local copy so filling them does not read the slow link. One rank: with two
    ranks on one link, how the link splits between them changes from run to run, and the
    all-reduce turns that into job-throughput noise (seen up to +-8%) that no bandwidth model
    predicts; the model is about storage and cache, so it is checked where only they vary."""
    with serve_directory(root, latency_s=latency_s, link_bytes_per_s=bandwidth) as server:
        cfg = _cfg(
            server.url,
            [loader],
            step_ms=step_ms,
            analyze=True,
            whatif_cache_fraction=0.5,
            steps=20,
            batch_size=32,
            warmup=4,
            warm_from=str(root),
            nproc=1,
        )
        rep = run_bench(cfg)
    print(format_analysis(rep["analysis"]))
    w = rep["analysis"]["whatif"]
    return {
        "loader": loader,
        "storage_bytes_per_s": bandwidth,
        "latency_ms": latency_s * 1e3,
        "step_ms": step_ms,
        "rates": rep["analysis"]["rates"],
        "stall": rep["analysis"]["stall"],
        "phases_samples_per_s": rep["analysis"]["phases_samples_per_s"],
        "whatif": w,
        "pass": w["error"] is not None and w["error"] <= 0.10,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="a,b,c", help="which benchmarks (comma list of a, b, c)")
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--c-loader", default="stallfree,torch", help="loaders analysed in (c), one run each")
    ap.add_argument(
        "--c-bandwidth", type=float, default=1e6, help="(c) storage bytes/s, all requests together"
    )
    ap.add_argument("--c-latency-ms", type=float, default=2.0)
    ap.add_argument("--c-step-ms", type=float, default=20.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    which = set(args.only.split(","))
    results: dict = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        root = write_jpeg_shards(Path(tmp) / "shards", args.samples, per_shard=64, size=(160, 120))
        if "a" in which:
            print("== (a) local shards, loader capacity >= 1.2x step rate")
            results["a"] = bench_a(root)
        if "b" in which:
            print("== (b) shards over loopback HTTP, +20 ms per request")
            results["b"] = bench_b(root)
        if "c" in which:
            print("== (c) what-if prediction vs measured run (HTTP, bandwidth-capped)")
            big = write_jpeg_shards(Path(tmp) / "big", args.samples, per_shard=256, size=(160, 120))
            runs = [
                bench_c(big, name, args.c_bandwidth, args.c_latency_ms / 1e3, args.c_step_ms)
                for name in args.c_loader.split(",")
            ]
            results["c"] = {"runs": runs, "pass": all(r["pass"] for r in runs)}
    results["elapsed_s"] = time.time() - t0
    print(json.dumps(results, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    ok = all(r["pass"] for k, r in results.items() if k in ("a", "b", "c"))
    print("PASS" if ok else "FAIL", {k: r["pass"] for k, r in results.items() if k in ("a", "b", "c")})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
