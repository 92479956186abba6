"""``stallfree demo``: the Quick start's main job on an embedded default dataset.

Makes a small ImageFolder of real-photo JPEGs, shards it (tar + DALI .idx + manifest), reads it
back through ``stallfree.DataLoader`` with the image decode preset, and runs a short
``stallfree bench`` comparison against torch's DataLoader on the same shards.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from stallfree.cli._common import describe, fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="make a small real-photo dataset, shard it, load it, and show a short stall benchmark",
        description=describe(
            "The Quick start's main job in one command: make --images real-photo JPEGs in 8 classes "
            "(an ImageFolder), shard them (tar + DALI .idx + manifest.json), read one epoch through "
            "stallfree.DataLoader with decode=ImageDecode(train=True), then run a short two-rank "
            "stallfree bench against torch's DataLoader on the same shards (--bench-steps 0 skips it). "
            "Everything goes under --workdir, or a temporary directory removed at the end."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree demo --images 512 --workdir ./demo-data",
    )
    p.add_argument("--images", type=int, default=512, help="number of JPEGs to generate (default 512)")
    p.add_argument("--workdir", type=Path, default=None, help="where to put the data (default: a temp dir)")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (default 2)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--size", type=int, default=128, help="output image side in pixels (default 128)")
    p.add_argument("--bench-steps", type=int, default=12, help="steps per loader in the bench (0: skip)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallfree.cli.doctor import version_lines

    refused = _refused(args)
    if refused:
        return fail("demo", refused, 2)
    for line in version_lines():  # what the timings below depend on (a PIL fallback is slower)
        print(line, flush=True)
    with tempfile.TemporaryDirectory(prefix="stallfree-demo-") as tmp:
        work = (args.workdir or Path(tmp)).resolve()
        return _run(args, work)


MAX_SIZE = 1024  # the decoded side; larger only makes the demo's batches huge (size 100000: 960 GB)
BENCH_RANKS, BENCH_BATCH = 2, 16


def _refused(args: argparse.Namespace) -> str | None:
    """Why the flags cannot run, checked before anything is made; None when they can."""
    if args.images < 8:
        return f"--images must be at least 8, got {args.images}"
    if args.batch_size < 1:
        return f"--batch-size must be at least 1, got {args.batch_size}"
    if args.workers < 0:
        return f"--workers must be 0 or more, got {args.workers}"
    if not 1 <= args.size <= MAX_SIZE:
        return f"--size must be 1 to {MAX_SIZE} pixels, got {args.size}"
    if args.bench_steps < 0:
        return f"--bench-steps must be 0 or more, got {args.bench_steps}"
    return None


def _run(args: argparse.Namespace, work: Path) -> int:
    from stallfree.shards.open import open_dataset
    from stallfree.shards.parallel import shard_dataset
    from stallfree.shards.sources.registry import open_source
    from stallfree.testing.images import make_image_folder

    classes = 8
    images, shards = work / "images", work / "shards"
    print(f"[1/4] making {args.images} real-photo JPEGs in {classes} classes under {images}", flush=True)
    t0 = time.perf_counter()
    if not images.exists():
        make_image_folder(images, classes=classes, per_class=args.images // classes)
    print(f"      done in {time.perf_counter() - t0:.1f}s", flush=True)

    print(f"[2/4] sharding into {shards} (tar + DALI .idx + manifest.json)", flush=True)
    summary = shard_dataset(
        open_source(str(images)),
        str(shards),
        format="tar",
        max_samples=max(8, args.images // 4),
        workers=1,
        overwrite=True,
    )
    ds = open_dataset(str(shards))
    print(
        f"      {len(ds)} samples in {len(ds.manifest.shards)} shards, "
        f"{ds.manifest.bytes / 1e6:.1f} MB, {summary.seconds:.2f}s",
        flush=True,
    )

    print("[3/4] one epoch through stallfree.DataLoader with decode=ImageDecode(train=True)", flush=True)
    _one_epoch(ds, args)

    if args.bench_steps > 0:
        print("[4/4] stallfree bench: stallfree vs torch DataLoader, 2 ranks, 20 ms steps", flush=True)
        return _bench(shards, len(ds), args)
    return 0


def _one_epoch(ds, args: argparse.Namespace) -> None:
    from stallfree import DataLoader, ImageDecode

    decode = ImageDecode(train=True, size=args.size)
    loader = DataLoader(
        ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, seed=0, decode=decode
    )
    t0 = time.perf_counter()
    first = None
    n = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
            shape = tuple(batch["image"].shape)
            labels = batch["label"][:8].tolist()
        n += len(batch["label"])
    wall = time.perf_counter() - t0
    st = loader.stats()
    print(f"      first batch: image {shape} {batch['image'].dtype}, labels {labels} ...", flush=True)
    print(
        f"      {n} samples in {wall:.2f}s = {n / wall:.0f} samples/s; first batch after {first:.2f}s; "
        f"decode backend: {st.get('decode', {}).get('backend')}",
        flush=True,
    )


def _bench(shards: Path, samples: int, args: argparse.Namespace) -> int:
    from stallfree.errors import ShardError
    from stallfree.harness.errors import RankFailed, error_line
    from stallfree.harness.report import format_table
    from stallfree.harness.runner import BenchConfig, run_bench

    # every rank must fill a batch each epoch (the bench drops the last partial one)
    batch_size = max(1, min(BENCH_BATCH, samples // BENCH_RANKS))
    cfg = BenchConfig(
        dataset=str(shards),
        loaders=["stallfree", "torch"],
        nproc=BENCH_RANKS,
        step="sleep",
        step_ms=20.0,
        batch_size=batch_size,
        workers=1,
        steps=args.bench_steps,
        warmup=2,
        image_size=64,
    )
    try:
        report = run_bench(cfg)
    except (ShardError, RankFailed, RuntimeError, ValueError) as exc:  # one line, as stallfree bench
        return fail("demo", f"the bench failed: {error_line(exc)}")
    if report is not None:
        print(format_table(report, per_rank=False), flush=True)
    return 0
