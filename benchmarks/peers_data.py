"""The data set for bench_peers.py, written once into a cache folder and reused.

``DIR/train``: an ImageFolder tree (``class_XXX/img_XXXXXX.jpg``) of ImageNet-like JPEGs derived
from real photographs (``stallfree.testing.images.make_imagenet_like_folder``: ImageNet's size mix,
about 95 KB per file, 4:2:0 and 4:4:4 chroma); ``DIR/shards``: the same files as tar shards with
``.idx`` and ``manifest.json``, written by ``stallfree shard`` (WebDataset layout, readable by
DALI's ``readers.webdataset`` and ours). ``DIR/dataset.json`` records what was asked for and the
statistics achieved; a folder whose record matches is reused as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATOR_VERSION = 1  # bump when make_imagenet_like_folder's output changes
MARKER = "dataset.json"


@dataclass(frozen=True)
class PeersData:
    root: Path
    folder: Path  # ImageFolder tree
    shards: Path  # tar shards + .idx + manifest.json
    stats: dict[str, Any]

    @property
    def tars(self) -> list[str]:
        return sorted(str(p) for p in self.shards.glob("*.tar"))

    @property
    def idxs(self) -> list[str]:
        return [t[: -len(".tar")] + ".idx" for t in self.tars]


def prepare(
    root: str | Path,
    images: int,
    *,
    classes: int = 50,
    seed: int = 0,
    workers: int = 2,
    shard_bytes: str = "64MB",
) -> PeersData:
    """The data set in ``root``: reused when its record matches, else written (``root`` must then be
    absent, empty, or a data set this script wrote earlier)."""
    root = Path(root)
    want = {"generator": GENERATOR_VERSION, "images": images, "classes": classes, "seed": seed}
    marker = root / MARKER
    if marker.exists():
        record = json.loads(marker.read_text())
        if all(record.get(k) == v for k, v in want.items()):
            return _data(root, record["stats"])
        print(f"[data] {root}: made for {record.get('images')} images / seed {record.get('seed')}; rewriting")
        for sub in ("train", "shards"):
            shutil.rmtree(root / sub, ignore_errors=True)
        marker.unlink()
    elif root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} exists and is not a bench_peers data set (no {MARKER}); pick another --dir")

    from stallfree.testing.images import make_imagenet_like_folder

    t0 = time.perf_counter()
    print(f"[data] writing {images} ImageNet-like JPEGs into {root / 'train'} ...", flush=True)
    stats = make_imagenet_like_folder(root / "train", images, classes=classes, seed=seed, workers=workers)
    print(f"[data] {time.perf_counter() - t0:.0f}s; sharding with stallfree shard ...", flush=True)
    cmd = [sys.executable, "-m", "stallfree", "shard", str(root / "train"), str(root / "shards")]
    cmd += [
        "--format",
        "tar",
        "--max-bytes",
        shard_bytes,
        "--shuffle-seed",
        str(seed),
        "--workers",
        str(workers),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    marker.write_text(json.dumps({**want, "stats": stats}, indent=1))
    return _data(root, stats)


def _data(root: Path, stats: dict[str, Any]) -> PeersData:
    data = PeersData(root, root / "train", root / "shards", stats)
    if not data.tars or not all(os.path.exists(p) for p in data.idxs):
        raise SystemExit(
            f"{data.shards}: tar shards or their .idx files are missing; delete {root} and rerun"
        )
    return data


def warm_page_cache(data: PeersData) -> int:
    """Read every file once so each runner starts from a warm page cache; returns bytes read."""
    total = 0
    for path in [*data.folder.rglob("*.jpg"), *data.shards.iterdir()]:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                total += len(chunk)
    return total


def describe(stats: dict[str, Any]) -> str:
    chroma = ", ".join(f"{k} {v:.0%}" for k, v in stats["subsampling"].items())
    return (
        f"{stats['images']} JPEGs, mean {stats['mean_width']:.0f}x{stats['mean_height']:.0f} px, "
        f"mean {stats['mean_kb']:.1f} KB (min {stats['min_kb']:.0f}, max {stats['max_kb']:.0f}), {chroma}"
    )
