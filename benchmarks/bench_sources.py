"""Sharding users' data as it is: a Hugging Face ``save_to_disk`` image dataset through
``stallfree shard`` vs the by-hand re-export users wrote before (``datasets`` rows, decoding off,
into ``webdataset.ShardWriter``), and what the shard-time shuffle (the default for grouped
sources) costs against source order. Same process, runs alternate, medians compared.

The dataset: ``--images`` real-photo JPEGs (320x240 crops, ~20 KB) with a 10-class ClassLabel,
rows class-sorted as ``datasets``' imagefolder loader writes them, generated once into
benchmarks/out/sources-bench. Ours also writes DALI ``.idx`` files, a manifest and per-shard
sha256 (the peer writes none of these).

    .venv/bin/python benchmarks/bench_sources.py [--images 1500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "out" / "sources-bench"
PER_SHARD = 500


def make_dataset(n: int) -> Path:
    import datasets

    from stallfree.testing.images import jpeg_bytes

    saved = ROOT / f"hf-{n}"
    if (saved / "state.json").exists():
        return saved
    images = jpeg_bytes(n, seed=0, sizes=((320, 240), (240, 320)))
    labels = sorted(i % 10 for i in range(n))
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[f"c{i}" for i in range(10)])}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "label": labels}, features=features
    )
    ds.save_to_disk(str(saved))
    return saved


def make_folder(saved: Path) -> Path:
    """The same images as an ImageFolder tree (class = sub-folder), for the shuffle's cost there."""
    import datasets

    folder = saved.parent / (saved.name + "-folder")
    if (folder / ".complete").exists():
        return folder
    ds = datasets.load_from_disk(str(saved)).cast_column("image", datasets.Image(decode=False))
    for i, row in enumerate(ds):
        d = folder / f"c{row['label']}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:06d}.jpg").write_bytes(row["image"]["bytes"])
    (folder / ".complete").write_text("")
    return folder


def ours(saved: Path, out: Path, shuffle: bool) -> None:
    from stallfree.shards.parallel import shard_dataset
    from stallfree.shards.sources.registry import open_source

    shard_dataset(
        open_source(str(saved)), str(out), max_samples=PER_SHARD, shuffle_seed=0 if shuffle else None
    )


def by_hand(saved: Path, out: Path) -> None:
    import datasets
    import webdataset as wds

    ds = datasets.load_from_disk(str(saved)).cast_column("image", datasets.Image(decode=False))
    out.mkdir(parents=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i, row in enumerate(ds):
            sink.write({"__key__": f"{i:09d}", "jpg": row["image"]["bytes"], "cls": row["label"]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    saved = make_dataset(args.images)
    nbytes = sum(p.stat().st_size for p in saved.glob("*.arrow"))
    for p in saved.glob("*.arrow"):
        p.read_bytes()  # page cache
    folder = make_folder(saved)
    for p in folder.rglob("*.jpg"):
        p.read_bytes()
    runs = {
        "HF dir: datasets rows -> webdataset.ShardWriter (by hand)": lambda o: by_hand(saved, o),
        "HF dir: stallfree shard, source order (--no-shuffle)": lambda o: ours(saved, o, False),
        "HF dir: stallfree shard, shuffled (the default: class-sorted rows)": lambda o: ours(saved, o, True),
        "ImageFolder: stallfree shard, source order (--no-shuffle)": lambda o: ours(folder, o, False),
        "ImageFolder: stallfree shard, shuffled (the default)": lambda o: ours(folder, o, True),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            out = ROOT / "out"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            fn(out)
            times[name].append(time.perf_counter() - t0)
    shutil.rmtree(ROOT / "out", ignore_errors=True)
    peer = statistics.median(times[next(iter(runs))])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"run": name, "median_s": round(med, 3), "MB_per_s": round(nbytes / 1e6 / med, 1),
                     "time_vs_by_hand": round(med / peer, 2)})  # fmt: skip
    print(f"{args.images} images, {nbytes / 1e6:.1f} MB of Arrow, {args.repeats} repeats", file=sys.stderr)
    print("| run | median s | MB/s | time vs by hand |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['median_s']} | {r['MB_per_s']} | {r['time_vs_by_hand']}x |")
    print(json.dumps(rows), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
