"""What keeping batches costs: ``list(loader)`` once the worker's slot pool is all held.

Rows, each ``--batches`` batches of ``--batch`` x 3 x ``--size`` x ``--size`` float32 from one
worker, rounds interleaved in one process (the machine is noisy: compare within a round):

- ``pool, dropped``: batches consumed and dropped: every batch reuses a pool slot (the fast path);
- ``pool, kept``: batches kept, fewer than the pool's cap: the pool grows one slot per batch;
- ``handover, kept``: batches kept, with the pool capped at one slot (``Slots.HARD_CAP``, set
  before the worker forks) so every batch goes out in its own consumer-owned segment, the path
  taken once more than 256 batches per worker are held;
- ``torch, kept``: torch's DataLoader, batches kept (its way for every batch).

    .venv/bin/python benchmarks/bench_kept.py [--batches 120] [--batch 16] [--size 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.utils.data as tud

from stallfree import DataLoader
from stallfree.loader.shm import slots


class Images(tud.Dataset):
    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, self.size, self.size), float(i))


def _run(make, keep: bool) -> float:
    t0 = time.perf_counter()
    kept = []
    for b in make():
        if keep:
            kept.append(b)
    took = time.perf_counter() - t0
    del kept
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=120)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    ds = Images(args.batches * args.batch, args.size)
    cap = slots.Slots.HARD_CAP

    def ours() -> DataLoader:
        return DataLoader(ds, batch_size=args.batch, num_workers=1)

    def theirs() -> tud.DataLoader:
        return tud.DataLoader(ds, batch_size=args.batch, num_workers=1)

    times: dict[str, list[float]] = {
        "pool, dropped": [],
        "pool, kept": [],
        "handover, kept": [],
        "torch, kept": [],
    }
    for _ in range(args.rounds):
        times["pool, dropped"].append(_run(ours, keep=False))
        times["pool, kept"].append(_run(ours, keep=True))
        slots.Slots.HARD_CAP = 1
        try:
            times["handover, kept"].append(_run(ours, keep=True))
        finally:
            slots.Slots.HARD_CAP = cap
        times["torch, kept"].append(_run(theirs, keep=True))
    base = statistics.median(times["pool, dropped"])
    mb = args.batch * 3 * args.size * args.size * 4 / 2**20
    print(f"{args.batches} batches of {mb:.2f} MiB, 1 worker, median of {args.rounds} rounds")
    print(f"{'path':<16} {'ms/batch':>9} {'vs pool':>8}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<16} {1000 * med / args.batches:>9.2f} {med / base:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
