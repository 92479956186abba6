"""Sharding speed: ``stallfree shard`` (one worker) vs ``tar cf`` of the same JPEGs, same run.

4,000 ImageNet-sized JPEGs (500x375 real-photo crops with sensor-like grain, quality 95: ~110 KB
each, ~440 MB) are generated once into benchmarks/out/shard-bench/images (an ImageFolder of 10
classes) and reused. Both sides read page-cached files and write to the same disk; runs alternate
(tar, ours, tar, ours, ...) and the median of each is compared. Target: ours <= 1.5x tar's time.

    .venv/bin/python benchmarks/bench_shard.py [--images 4000] [--repeats 3] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent / "out" / "shard-bench"


def make_images(root: Path, n: int, classes: int = 10) -> Path:
    """ImageFolder of ``n`` ~110 KB JPEGs (cached: regenerated only if the count differs)."""
    from stallfree.testing.images import base_photos, encode_jpeg, make_image

    marker = root / f".complete-{n}"
    if marker.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    photos = base_photos()
    t0 = time.perf_counter()
    for i in range(n):
        d = root / f"n{i % classes:08d}"
        d.mkdir(parents=True, exist_ok=True)
        img = np.asarray(make_image(rng, photos, (500, 375)), np.float32)
        img = np.clip(img + rng.normal(0, 10, img.shape), 0, 255).astype(np.uint8)
        (d / f"n{i % classes:08d}_{i:06d}.JPEG").write_bytes(encode_jpeg(Image.fromarray(img), 95))
    marker.write_text("")
    print(f"generated {n} JPEGs in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return root


def warm(root: Path) -> int:
    total = 0
    for p in root.rglob("*.JPEG"):
        total += len(p.read_bytes())
    return total


def run_tar(src: Path, dst: Path) -> float:
    dst.unlink(missing_ok=True)
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["tar", "cf", str(dst), "-C", str(src), "."], check=True)
    return time.perf_counter() - t0


def run_ours(src: Path, dst: Path, workers: int = 1) -> tuple[float, dict]:
    from stallfree.shards.parallel import shard_dataset
    from stallfree.shards.sources import open_source

    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    t0 = time.perf_counter()
    summary = shard_dataset(open_source(src), str(dst), format="tar", max_bytes=256_000_000, workers=workers)
    return time.perf_counter() - t0, summary.to_json()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="profile one run of ours with pyinstrument")
    args = ap.parse_args()

    src = make_images(ROOT / f"images-{args.images}", args.images)
    nbytes = warm(src)
    tar_out, ours_out = ROOT / "tar-out.tar", ROOT / "ours-out"
    if args.profile:
        from pyinstrument import Profiler

        prof = Profiler(interval=0.001)
        prof.start()
        run_ours(src, ours_out)
        prof.stop()
        print(prof.output_text(unicode=False, color=False, show_all=False))
    tar_times, ours_times = [], []
    summary: dict = {}
    run_ours(src, ours_out)  # warm-up (imports, first-touch of the output directory)
    for _ in range(args.repeats):
        tar_times.append(run_tar(src, tar_out))
        t, summary = run_ours(src, ours_out)
        ours_times.append(t)
    tar_s, ours_s = statistics.median(tar_times), statistics.median(ours_times)
    result = {
        "images": args.images,
        "source_mb": round(nbytes / 1e6, 1),
        "avg_image_kb": round(nbytes / args.images / 1e3, 1),
        "tar_cf_s": [round(t, 3) for t in tar_times],
        "stallfree_shard_s": [round(t, 3) for t in ours_times],
        "tar_cf_median_s": round(tar_s, 3),
        "stallfree_median_s": round(ours_s, 3),
        "tar_cf_mb_per_s": round(nbytes / 1e6 / tar_s, 1),
        "stallfree_mb_per_s": round(nbytes / 1e6 / ours_s, 1),
        "ratio_ours_over_tar": round(ours_s / tar_s, 3),
        "target_ratio": 1.5,
        "shards": summary.get("shards"),
        "tar_out_bytes": tar_out.stat().st_size,
        "ours_out_bytes": summary.get("bytes"),
    }
    print(json.dumps(result, indent=1))
    (ROOT / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(ours_out, ignore_errors=True)
    tar_out.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
