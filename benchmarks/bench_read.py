"""Shard read throughput from page-cached local shards, beside ``cat`` of the same files.

Writes a tar dataset of ``--samples`` samples of ``--sample-kb`` KB (random payload, plus a
``cls`` label, as an image dataset has), warms the page cache, then in one run measures:
  cat        ``cat shards > /dev/null`` (the baseline: raw page-cache read speed; ``read()`` into
             one reused buffer, no per-sample object)
  seq-cold   ``for s in open_dataset(root)``: a fresh dataset each run (reads the manifest and each
             shard's ``.idx``, maps the shards, page-faults the mappings in, closes them)
  seq-iter   ``for s in ds``, dataset already open (its mappings populated by an earlier pass)
  seq-index  ``ds[i]`` for i in order
  random     ``ds[i]`` in a random permutation (one sample at a time)
  random-many ``ds.get_many(batch)`` over random batches of 256
Each is the best of ``--repeat`` runs (shared, noisy machine). Reports samples/s, MB/s and the
ratio to cat's MB/s; also MB per CPU-second (user+sys of this process, or of cat), which a
loaded machine disturbs less than wall time. Our MB are sample payload bytes (every field a fresh
``bytes`` object); cat's are whole-file bytes (tar headers and padding too, ~2% more).
``--format arrow`` measures Arrow shards instead.

    .venv/bin/python benchmarks/bench_read.py --samples 2000 --sample-kb 100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter


def build(root: Path, n: int, size: int, fmt: str) -> None:
    payload = os.urandom(size + 4096)
    with ShardWriter(str(root), format=fmt, max_bytes=64_000_000) as w:
        for i in range(n):
            off = (i * 61) % 4096
            w.write({"__key__": f"s{i:07d}", "jpg": payload[off : off + size], "cls": i % 1000})


def best(fn, repeat: int, child: bool = False) -> tuple[float, float]:
    """Best wall time and best CPU time (user+sys; of the child processes when ``child``) of
    ``repeat`` runs. CPU time is what one core spends, and is steadier than wall time on a
    shared machine."""
    walls, cpus = [], []
    for _ in range(repeat):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN if child else resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN if child else resource.RUSAGE_SELF)
        cpus.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
    return min(walls), max(min(cpus), 1e-6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--sample-kb", type=int, default=100)
    ap.add_argument("--format", choices=("tar", "arrow"), default="tar")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument(
        "--retain-freed-memory",
        action="store_true",
        help="call stallfree.loader.shm.memory.retain_freed_memory() first (glibc thresholds; see its docstring)",
    )
    args = ap.parse_args(argv)
    retained = False
    if args.retain_freed_memory:
        from stallfree.loader.shm.memory import retain_freed_memory

        retained = retain_freed_memory()

    with tempfile.TemporaryDirectory(prefix="bench_read_") as tmp:
        root = Path(tmp) / "ds"
        size = args.sample_kb * 1000
        build(root, args.samples, size, args.format)
        ds = open_dataset(str(root))
        files = [str(root / s.path) for s in ds.manifest.shards]
        total_bytes = sum(os.path.getsize(f) for f in files)
        payload = args.samples * size
        n = len(ds)

        def cat() -> None:
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)

        def seq_iter() -> None:
            for _ in ds:
                pass

        def seq_cold() -> None:  # a fresh dataset: opens shards, maps them, faults pages in
            fresh = open_dataset(str(root))
            for _ in fresh:
                pass
            fresh.close()

        def seq_index() -> None:
            get = ds.__getitem__
            for i in range(n):
                get(i)

        order = list(range(n))
        random.Random(0).shuffle(order)

        def rand() -> None:
            get = ds.__getitem__
            for i in order:
                get(i)

        def rand_many() -> None:
            for j in range(0, n, 256):
                ds.get_many(order[j : j + 256])

        cat()  # warm the page cache
        seq_iter()  # and open every shard
        results = {}
        t_cat, c_cat = best(cat, args.repeat, child=True)
        results["cat"] = {
            "seconds": t_cat,
            "cpu_seconds": c_cat,
            "MB/s": total_bytes / t_cat / 1e6,
            "MB/cpu-s": total_bytes / c_cat / 1e6,
        }
        runs = (
            ("seq-cold", seq_cold),
            ("seq-iter", seq_iter),
            ("seq-index", seq_index),
            ("random", rand),
            ("random-many", rand_many),
        )
        for name, fn in runs:
            t, c = best(fn, args.repeat)
            results[name] = {
                "seconds": t,
                "cpu_seconds": c,
                "samples/s": n / t,
                "MB/s": payload / t / 1e6,
                "MB/cpu-s": payload / c / 1e6,
                "vs cat MB/s": (payload / t) / (total_bytes / t_cat),
                "vs cat MB/cpu-s": (payload / c) / (total_bytes / c_cat),
            }
    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    meta = {
        "malloc_env": malloc_env,
        "format": args.format,
        "samples": n,
        "sample_bytes": size,
        "shard_bytes": total_bytes,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=1))
        return 0
    print(
        f"{args.format} shards: {n} samples x {size / 1000:.0f} KB, {total_bytes / 1e6:.0f} MB on disk, page-cached"
    )
    if malloc_env or retained:
        print(f"glibc malloc settings: env {malloc_env}, retain_freed_memory() {retained}")
    print(f"{'reader':<12} {'samples/s':>11} {'MB/s':>9} {'vs cat':>7} {'MB/cpu-s':>9} {'vs cat':>7}")
    c = results["cat"]
    print(f"{'cat':<12} {'':>11} {c['MB/s']:>9.0f} {'1.00':>7} {c['MB/cpu-s']:>9.0f} {'1.00':>7}")
    for name, r in results.items():
        if name != "cat":
            print(
                f"{name:<12} {r['samples/s']:>11.0f} {r['MB/s']:>9.0f} {r['vs cat MB/s']:>7.2f} "
                f"{r['MB/cpu-s']:>9.0f} {r['vs cat MB/cpu-s']:>7.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
