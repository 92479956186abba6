"""What pinning remote reads to a version costs (issue 36 item 4): ``ds[i]`` over loopback S3
(moto) with reads pinned (``If-Match`` the ETag, through s3fs's client) and unpinned (s3fs's
``cat_file``), and over the loopback HTTP server (no ETag: members checked against ``.sums``)
with and without the CRC check. One process, rounds interleaved (pinned, unpinned, pinned, ...),
the best rate and CPU of each case, and the median of the per-pair ratios checked/plain (the
machine is shared: a pair shares its load), and the CPU of the CRC check alone.

    .venv/bin/python benchmarks/bench_remote_pin.py
    .venv/bin/python benchmarks/bench_remote_pin.py --samples 400 --size 100000 --rounds 5

"Plain" is the same dataset with the pin (or the CRC check) taken off its opened readers
(``reader.pin = None``, ``reader.member_check = None``): the reads before issue 36. CPU is the
process's (the HTTP server's threads included; moto runs in its own process, not counted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stallfree.shards.open import open_dataset  # noqa: E402
from stallfree.shards.tar.sums import MemberSums, checksum  # noqa: E402
from stallfree.shards.writer import ShardWriter  # noqa: E402
from stallfree.testing.httpserve import serve_directory  # noqa: E402
from stallfree.testing.s3serve import serve_s3  # noqa: E402


def write(url: str, samples: int, size: int, **options) -> None:
    rng = np.random.default_rng(0)
    with ShardWriter(url, format="tar", max_samples=100, **options) as w:
        for i in range(samples):
            w.write({"__key__": f"s{i:06d}", "jpg": rng.bytes(size), "cls": i % 1000})


def opened(url: str, **options):
    """The dataset with every shard open (its pin or CRC check recorded), timed reads after."""
    ds = open_dataset(url, **options)
    for s in range(len(ds.shard_sizes)):
        ds[sum(ds.shard_sizes[:s])]
    return ds


def readers(ds) -> list:
    return [ds._reader(s) for s in range(len(ds.shard_sizes))]


def one_pass(ds, order: np.ndarray) -> tuple[float, float]:
    """(samples/s, CPU ms per sample) of ``ds[i]`` for every ``i`` of ``order``."""
    c0, t0 = time.process_time(), time.perf_counter()
    for i in order:
        ds[int(i)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return len(order) / wall, cpu * 1000 / len(order)


def compare(label: str, checked, plain, order: np.ndarray, rounds: int) -> tuple:
    """Paired rounds, the order of the two alternating: the best rate and CPU of each, and the
    median of the per-round ratios (a shared machine's load drifts; a pair shares its drift)."""
    best: dict[str, list[float]] = {"checked": [0.0, float("inf")], "plain": [0.0, float("inf")]}
    time_ratios, cpu_ratios = [], []
    for k in range(rounds):
        pair = [("checked", checked), ("plain", plain)][:: 1 if k % 2 == 0 else -1]
        got = {name: one_pass(ds, order) for name, ds in pair}
        for name, (rate, cpu) in got.items():
            best[name] = [max(best[name][0], rate), min(best[name][1], cpu)]
        time_ratios.append(got["plain"][0] / got["checked"][0])
        cpu_ratios.append(got["checked"][1] / got["plain"][1])
    return (
        label,
        best["plain"][0],
        best["checked"][0],
        statistics.median(time_ratios),
        best["plain"][1],
        best["checked"][1],
        statistics.median(cpu_ratios),
    )


def check_cpu_us(samples: list[dict], repeats: int = 5) -> float:
    """CPU microseconds per sample of the ``.sums`` check alone (``sums.MemberSums`` over the
    members of samples already read: no network), the best of ``repeats``."""
    datas = [v for s in samples for k, v in s.items() if k != "__key__"]
    check = MemberSums(array("I", (checksum(d) for d in datas)), "bench")
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        for j, data in enumerate(datas):
            check(j, "key", "field", data, 0)
        best = min(best, time.process_time() - c0)
    return best * 1e6 / len(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--size", type=int, default=100_000, help="bytes of each sample's jpg")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    order = np.random.default_rng(1).permutation(args.samples)
    results = []
    with serve_s3() as s3:
        s3.create_bucket("bench")
        write("s3://bench/ds", args.samples, args.size, **s3.storage_options)
        pinned = opened("s3://bench/ds", **s3.storage_options)
        plain = opened("s3://bench/ds", **s3.storage_options)
        assert all(r.pin is not None for r in readers(pinned))
        for r in readers(plain):
            r.pin = None
        results.append(compare("S3 (moto): If-Match vs unpinned", pinned, plain, order, args.rounds))
    with tempfile.TemporaryDirectory() as tmp:
        write(os.path.join(tmp, "ds"), args.samples, args.size)
        with serve_directory(tmp) as server:
            crc = opened(f"{server.url}/ds")
            plain = opened(f"{server.url}/ds")
            assert all(r.member_check is not None and r.pin is None for r in readers(crc))
            for r in readers(plain):
                r.member_check = None
            results.append(compare("HTTP (no ETag): .sums CRC vs unchecked", crc, plain, order, args.rounds))
            alone = check_cpu_us([plain[int(i)] for i in order])
    print(
        f"{args.samples} samples of {args.size} bytes (+ a label), random order, "
        f"{args.rounds} paired rounds (best rate and CPU of each; ratios: median of the pairs)\n"
    )
    print(
        "| case | plain samples/s | checked samples/s | time ratio | CPU ms/sample plain | checked | CPU ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, rp, rc, tr, cp, cc, cr in results:
        print(f"| {label} | {rp:,.0f} | {rc:,.0f} | {tr:.2f} | {cp:.3f} | {cc:.3f} | **{cr:.2f}** |")
    print(f"\nthe .sums check alone (no network): {alone:.1f} us of CPU per sample")


if __name__ == "__main__":
    main()
