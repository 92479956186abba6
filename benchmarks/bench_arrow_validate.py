"""What validating Arrow record batches costs (issue 36 item 5): reading local Arrow shards with
the checks ``stallfree.shards.arrow.check`` makes (full validation of each batch, once per open;
the IPC footer's blocks checked at open) against no batch check and against pyarrow's cheap
``validate()``, rounds interleaved in one process, reported as ratios.

    .venv/bin/python benchmarks/bench_arrow_validate.py
    .venv/bin/python benchmarks/bench_arrow_validate.py --samples 20000 --size 1000 --rounds 7

Modes (swapped in by replacing ``arrow_check.validate_batch``, what ``BatchChecks`` calls):

- ``full`` (used): ``RecordBatch.validate(full=True)``: every offset, buffer size, UTF-8;
- ``cheap``: ``RecordBatch.validate()``: buffer sizes and, for a one-row batch, its only two
  offsets (enough for our one-row-per-batch shards, not for many-row batches);
- ``none``: no batch check (what crashed on damaged files).

The modes take turns going first within a round (order effects cancel). Three reads per mode
and round: ``ds[i]`` in a shuffled order (each sample once: the first read
of each batch, where the check runs), the same order again (the check's result cached), and a
``stallfree.DataLoader`` epoch (``num_workers=0``, ``batch_size=64``, list collate). Each round
opens the dataset afresh per mode. Also: the time to open a shard of ``--samples`` batches with
and without the footer check (``arrow_check.check_ipc_file``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stallfree.shards.arrow import check as arrow_check  # noqa: E402
from stallfree.shards.open import open_dataset  # noqa: E402
from stallfree.shards.writer import ShardWriter  # noqa: E402

FULL = arrow_check.validate_batch


def cheap(batch: Any, *, shard: str, batch_no: int, first_row: int | None = None, rows: int | None = None,
          offset: int | None = None) -> None:  # fmt: skip
    batch.validate()


def none(batch: Any, **_: Any) -> None:
    pass


MODES: dict[str, Callable[..., None]] = {"full (used)": FULL, "cheap validate()": cheap, "none": none}


def write(root: Path, samples: int, size: int) -> None:
    rng = np.random.default_rng(0)
    with ShardWriter(str(root), format="arrow", max_samples=samples) as w:
        for i in range(samples):
            w.write({"__key__": f"s{i:07d}", "jpg": rng.bytes(size), "cls": i % 1000, "txt": f"caption {i}"})


def reads(root: Path, order: list[int]) -> tuple[float, float, float]:
    """samples/s of: first random pass, second random pass, a loader epoch."""
    from stallfree import DataLoader

    ds = open_dataset(str(root))
    t0 = time.perf_counter()
    for i in order:
        ds[i]
    first = len(order) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in order:
        ds[i]
    again = len(order) / (time.perf_counter() - t0)
    ds.close()
    ds = open_dataset(str(root))
    loader = DataLoader(ds, batch_size=64, num_workers=0, collate_fn=list, shuffle=True, seed=0)
    t0 = time.perf_counter()
    n = sum(len(b) for b in loader)
    epoch = n / (time.perf_counter() - t0)
    ds.close()
    return first, again, epoch


def open_times(root: Path, repeat: int) -> dict[bool, float]:
    """Median seconds to open the shard and read its first sample, with and without the footer
    check, alternating."""
    real = arrow_check.check_ipc_file
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(repeat):
            for check in (True, False):
                arrow_check.check_ipc_file = real if check else (lambda *a, **k: None)
                t0 = time.perf_counter()
                ds = open_dataset(str(root))
                ds[0]
                times[check].append(time.perf_counter() - t0)
                ds.close()
    finally:
        arrow_check.check_ipc_file = real
    return {c: statistics.median(t) for c, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--size", type=int, default=1000, help="bytes of the binary field per sample")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        write(root, args.samples, args.size)
        order = list(np.random.default_rng(1).permutation(args.samples))
        order = [int(i) for i in order]
        reads(root, order[:1000])  # page cache, imports
        got: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
        names = list(MODES)
        for r in range(args.rounds):
            for mode in names[r % 3 :] + names[: r % 3]:  # each mode first, second and last in turn
                fn = MODES[mode]
                arrow_check.validate_batch = fn
                try:
                    got[mode].append(reads(root, order))
                finally:
                    arrow_check.validate_batch = FULL
        opened = open_times(root, args.rounds * 4)
        per_batch = per_batch_costs(root, args.rounds)
    size = f"{args.samples:,} samples of {args.size:,} B (+ cls, txt), one shard, one row per batch"
    print(f"\nArrow reads, {size}, {args.rounds} rounds (samples/s: median, best; ratio vs none)\n")
    print("| batch check      | ds[i] first pass      | vs none | ds[i] again           | vs none | loader epoch          | vs none |")  # fmt: skip
    print("|------------------|----------------------:|--------:|----------------------:|--------:|----------------------:|--------:|")  # fmt: skip
    base = [statistics.median(r[k] for r in got["none"]) for k in range(3)]
    for mode, runs in got.items():
        cells = []
        for k in range(3):
            med, best = statistics.median(r[k] for r in runs), max(r[k] for r in runs)
            cells.append(f"{med:,.0f} ({best:,.0f}) | {med / base[k]:.2f}")
        print(f"| {mode:<16} | {' | '.join(cells)} |")
    print(f"\nOpen + first sample, {args.samples:,} batches: footer check {opened[True] * 1e3:.2f} ms, "
          f"without {opened[False] * 1e3:.2f} ms (ratio {opened[True] / opened[False]:.2f})")  # fmt: skip
    print("\nPer batch, in one loop over the shard's batches (us, median of rounds):")
    for name, us in per_batch.items():
        print(f"  {name:<32} {us:6.2f}")


def per_batch_costs(root: Path, rounds: int) -> dict[str, float]:
    """Microseconds per batch of: reading it (``get_batch`` from the map), each check, and
    converting its row to Python (what ``ds[i]`` does after the check)."""
    import pyarrow as pa

    mm = pa.memory_map(str(root / "shard-000000.arrow"))
    reader = pa.ipc.open_file(mm)
    batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
    steps = {
        "get_batch": lambda b: reader.get_batch(b),
        "validate(full=True) (used)": lambda b: batches[b].validate(full=True),
        "validate() (cheap)": lambda b: batches[b].validate(),
        "row to Python (as_py per column)": lambda b: [c[0].as_py() for c in batches[b].columns],
    }
    out = {}
    for name, step in steps.items():
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for b in range(len(batches)):
                step(b)
            times.append((time.perf_counter() - t0) / len(batches) * 1e6)
        out[name] = statistics.median(times)
    return out


if __name__ == "__main__":
    main()
