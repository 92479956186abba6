"""``stallfree demo``: the Quick start's main job on an embedded default dataset."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="make a small real-photo dataset, shard it, load it, and show the stall table",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  stallfree demo --images 512 --workdir ./demo-data",
    )
    p.add_argument("--images", type=int, default=512, help="number of JPEGs to generate (default 512)")
    p.add_argument("--workdir", type=Path, default=None, help="where to put the data (default: a temp dir)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stallfree.testing.images import make_image_folder

    with tempfile.TemporaryDirectory(prefix="stallfree-demo-") as tmp:
        work = args.workdir or Path(tmp)
        t0 = time.perf_counter()
        classes = 8
        src = make_image_folder(work / "images", classes=classes, per_class=max(1, args.images // classes))
        n = sum(1 for _ in src.rglob("*.jpg"))
        print(f"made {n} JPEGs in {time.perf_counter() - t0:.1f}s under {src}")
    return 0
