"""What per-sample checksums cost: reading local tar shards with and without
``open_dataset(..., verify_samples=True)``, rounds interleaved in one process, and the throughput
of the checksum functions that could be used (those installed) on the same member size.

    .venv/bin/python benchmarks/bench_integrity.py
    .venv/bin/python benchmarks/bench_integrity.py --samples 2000 --size 100000 --rounds 5

The shards are written once into a temporary directory and read once before timing, so every
round reads from the page cache (the cost measured is the check, not the disk). Each round
iterates the whole dataset in order (``for sample in ds``), the plain and the checked run back to
back; the table gives the median samples/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stallfree.shards.open import open_dataset  # noqa: E402
from stallfree.shards.writer import ShardWriter  # noqa: E402


def write(root: Path, samples: int, size: int) -> None:
    rng = np.random.default_rng(0)
    with ShardWriter(str(root), format="tar", max_bytes=64 << 20) as w:
        for i in range(samples):
            w.write({"__key__": f"s{i:06d}", "jpg": rng.bytes(size), "cls": i % 1000})


def epoch_rate(root: Path, verify: bool) -> float:
    ds = open_dataset(str(root), verify_samples=verify)
    t0 = time.perf_counter()
    n = sum(1 for _ in ds)
    rate = n / (time.perf_counter() - t0)
    ds.close()
    return rate


def checksum_functions() -> dict[str, object]:
    """zlib's CRC32 and whichever faster alternatives are installed (none is a dependency)."""
    found: dict[str, object] = {"zlib.crc32 (used)": zlib.crc32, "zlib.adler32": zlib.adler32}
    for module, attr, name in [
        ("crc32c", "crc32c", "crc32c.crc32c"),
        ("google_crc32c", "value", "google_crc32c.value"),
        ("xxhash", "xxh32_intdigest", "xxhash.xxh32"),
        ("xxhash", "xxh3_64_intdigest", "xxhash.xxh3_64"),
    ]:
        try:
            found[name] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            pass
    return found


def hash_rates(size: int, rounds: int) -> list[tuple[str, float, float]]:
    """Per function: us per member over 64 buffers in cache (best of ``rounds``), and over 2,000
    distinct buffers (200 MB at 100 KB: out of cache, as members just read are)."""
    rng = np.random.default_rng(0)
    hot = [rng.bytes(size) for _ in range(64)]
    cold = [rng.bytes(size) for _ in range(2000)]
    out = []
    for name, fn in checksum_functions().items():
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for d in hot:
                fn(d)
            best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for d in cold:
            fn(d)
        out.append((name, best / len(hot) * 1e6, (time.perf_counter() - t0) / len(cold) * 1e6))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--size", type=int, default=100_000, help="bytes of the jpg field of each sample")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-integrity-") as tmp:
        root = Path(tmp) / "ds"
        write(root, args.samples, args.size)
        epoch_rate(root, False)  # into the page cache
        plain, checked = [], []
        for r in range(args.rounds):
            first, second = (False, True) if r % 2 == 0 else (True, False)  # alternate who goes first
            for verify in (first, second):
                (checked if verify else plain).append(epoch_rate(root, verify))
    p_med, c_med = statistics.median(plain), statistics.median(checked)
    print(
        f"{args.samples} samples of {args.size:,} B (+ a cls member), local tar, page cache, {args.rounds} rounds"
    )
    print()
    print("| read                    | samples/s (median) | range         | vs plain |")
    print("|-------------------------|-------------------:|---------------|---------:|")
    print(f"| plain                   | {p_med:18,.0f} | {min(plain):,.0f}-{max(plain):,.0f} | {1.0:8.2f} |")
    print(
        f"| verify_samples=True     | {c_med:18,.0f} | {min(checked):,.0f}-{max(checked):,.0f} | "
        f"{c_med / p_med:8.2f} |"
    )
    print()
    print(f"| checksum of {args.size:,} B | us in cache | us out of cache | GB/s out of cache |")
    print("|------------------------|------------:|----------------:|------------------:|")
    for name, hot_us, cold_us in hash_rates(args.size, 20):
        print(f"| {name:22s} | {hot_us:11.1f} | {cold_us:15.1f} | {args.size / cold_us / 1e3:17.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
