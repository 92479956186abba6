"""How a worker should fill a shared slot it let go of: ``pwrite`` into the slot's shm file
(``stallfree.loader.shm.storage.SlotFile``) vs writing through the mapping after ``MADV_DONTNEED``
(every page faults back in) vs the mapping kept resident (no faults, but the slot stays in the
worker's RSS). Same batch (32 x 3 x 224 x 224 float32 rows), same process, rounds interleaved.

    .venv/bin/python benchmarks/bench_slotwrite.py [--batch 32] [--size 224] [--rounds 5] [--reps 20]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import numpy as np
import torch

from stallfree.loader.shm import storage as shm


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)

    row = torch.from_numpy(np.random.default_rng(0).random((3, args.size, args.size), dtype=np.float32))
    storage = torch.UntypedStorage._new_shared(args.batch * row.numel() * 4)
    out = torch.empty(0, dtype=torch.uint8).set_(storage).view(torch.float32).view(args.batch, *row.shape)
    file = shm.SlotFile.of(storage)
    if file is None:
        sys.stderr.write("no slot file here (sharing strategy is not file_descriptor)\n")
        return 1

    def pwrite() -> None:
        for i in range(args.batch):
            file.write_tensor(out[i], row)

    def mapped_after_release() -> None:
        for i in range(args.batch):
            out[i].copy_(row)
        shm.release_pages(storage)  # as the worker does after sending the batch

    def mapped_resident() -> None:
        for i in range(args.batch):
            out[i].copy_(row)

    ways = {
        "pwrite": pwrite,
        "mapped_after_release": mapped_after_release,
        "mapped_resident": mapped_resident,
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    faults: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            fn()  # warm: the slot's pages exist in shared memory, as in steady state
            shm.release_pages(storage)
            f0, t0 = _faults(), time.perf_counter()
            for _ in range(args.reps):
                fn()
            times[name].append((time.perf_counter() - t0) / args.reps * 1e3)
            faults[name].append((_faults() - f0) / args.reps)
    assert torch.equal(out[-1], row)
    base = statistics.median(times["pwrite"])
    mb = args.batch * row.numel() * 4 / 2**20
    print(f"batch {args.batch} x {tuple(row.shape)} float32 = {mb:.1f} MiB, median of {args.rounds} rounds")
    print(f"{'way':<22} {'ms/batch':>9} {'faults/batch':>13} {'vs pwrite':>10}")
    for name in ways:
        t = statistics.median(times[name])
        print(f"{name:<22} {t:>9.2f} {statistics.median(faults[name]):>13.0f} {t / base:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
