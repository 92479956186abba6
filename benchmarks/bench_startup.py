"""Start-up of the image loader: the first batches, with and without the first-batch gate.

The same loader as ``bench_peers.py``'s ours-cpu / ours-auto (``stallfree.DataLoader`` over the
peer bench's tar shards, ``ImageDecode(train=True, size=224, dtype="uint8")``, batch 64, 2
workers, persistent, shuffled), built from nothing each round, in one process, rounds alternating
which way goes first:

  gate    : as shipped (``loader/first_batch.py``: the pool's first batch decodes on every
            worker's cores; the other workers hold their first decode for it)
  no-gate : the engine given no gate (every worker decodes its first batch on its own share,
            as before the change)

Per round: seconds from building the loader to batches 1, 2, 3, 4, 8 and 9 (medians over rounds),
and the main process's CPU to the first batch. A second table splits the first batch into its
steps: ``iter()`` (the pool's queues, shared arrays and forks), the lead worker's read, decode and
collate (its own timers, as ``loader.stats()["stages_s"]`` holds them when batch 1 is handed
over; with the gate only: batch 2's decode waits for batch 1's, so none of its time is in them,
while without it batch 2 may be in already), the main process's
transfer (adopting the slot, materialising the batch), and the rest: worker start-up, waiting for
the first task, and the result's trip to the main process (its first slot's file descriptor
included). ``--parent-mib`` makes the main process that much bigger first (resident pages), as a
training process or ``bench_peers.py``'s (~750 MB by our runners' turn) is: fork copies its page
tables. The gate moves work, it does not add any: the first
batch comes sooner, and the other worker's batches (2, 4, 8, ...) later by about half a batch's
decode, while the lead's (3, 9, ...) come sooner by as much. The data is the peer bench's: run
``bench_peers.py`` once first (its full run writes it; ``--smoke`` does not), or pass --dir.

  .venv/bin/python benchmarks/bench_startup.py --rounds 10
  .venv/bin/python benchmarks/bench_startup.py --rounds 10 --parent-mib 700
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

from stallfree import DataLoader, ImageDecode, open_dataset
from stallfree.loader import engine

MARKS = (1, 2, 3, 4, 8, 9)
STEPS = ("iter_s", "read_s", "decode_s", "collate_s", "transfer_s", "rest_s")


def one_round(shards: str, backend: str, gate: bool, workers: int) -> dict[str, float]:
    real = engine.FirstBatchGate
    if not gate:
        engine.FirstBatchGate = lambda _ctx: None  # type: ignore[assignment,misc]
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        loader = DataLoader(
            open_dataset(shards),
            batch_size=64,
            shuffle=True,
            num_workers=workers,
            persistent_workers=True,
            drop_last=True,
            seed=0,
            decode=ImageDecode(train=True, size=224, backend=backend, dtype="uint8"),
        )
        t_iter = time.perf_counter()
        it = iter(loader)
        t_pool = time.perf_counter()
        out: dict[str, float] = {"iter_s": t_pool - t_iter}
        for k in range(1, max(MARKS) + 1):
            batch = next(it)
            assert batch["image"].shape == (64, 3, 224, 224)
            if k == 1:
                out["main_cpu_s"] = time.process_time() - c0
                out.update(_first_batch_steps(loader.stats()["stages_s"], time.perf_counter() - t_pool))
            if k in MARKS:
                out[f"batch_{k}_s"] = time.perf_counter() - t0
            del batch
        del it, loader
        gc.collect()
        return out
    finally:
        engine.FirstBatchGate = real  # type: ignore[misc]


def _first_batch_steps(stages: dict[str, float], after_iter: float) -> dict[str, float]:
    """Batch 1's steps from the stage timers (only batch 1 is in them yet), and what is left of
    ``after_iter`` (the seconds from ``iter()``'s return to batch 1)."""
    steps = {
        "read_s": stages.get("fetch_s", 0.0),
        "decode_s": stages.get("decode_batch_s", 0.0),
        "collate_s": stages.get("collate_s", 0.0),
        "transfer_s": stages.get("transfer_s", 0.0),
    }
    steps["rest_s"] = after_iter - sum(steps.values())
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(__file__).parent / "out" / "peers-data-4000" / "shards"
    ap.add_argument("--dir", default=str(default), help="tar shards with a manifest (the peer bench's)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--parent-mib", type=int, default=0, help="resident MiB to add to this process first")
    args = ap.parse_args()
    ballast = b"\x01" * (args.parent_mib << 20)  # written, so resident; forks copy its page tables
    if not os.path.exists(os.path.join(args.dir, "manifest.json")):
        raise SystemExit(f"no dataset at {args.dir}: run benchmarks/bench_peers.py once (it writes it)")
    runs: dict[str, list[dict[str, Any]]] = {"gate": [], "no-gate": []}
    one_round(args.dir, args.backend, True, args.workers)  # page cache and imports warm for both
    for r in range(args.rounds):
        for name in ("gate", "no-gate") if r % 2 == 0 else ("no-gate", "gate"):
            runs[name].append(one_round(args.dir, args.backend, name == "gate", args.workers))
            time.sleep(0.3)  # the last pool's processes gone
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{args.rounds} rounds, backend={args.backend}, {args.workers} workers, "
        f"parent +{len(ballast) >> 20} MiB, load average {load}"
    )
    print("| loader | " + " | ".join(f"batch {k}" for k in MARKS) + " | main CPU to batch 1 |")
    print("|---|" + "---:|" * (len(MARKS) + 1))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    for name, m in med.items():
        cells = " | ".join(f"{m[f'batch_{k}_s']:.3f} s" for k in MARKS)
        print(f"| {name} | {cells} | {m['main_cpu_s'] * 1e3:.0f} ms |")
    ratio = " | ".join(f"{med['gate'][f'batch_{k}_s'] / med['no-gate'][f'batch_{k}_s']:.2f}" for k in MARKS)
    print(f"| gate / no-gate | {ratio} | |")
    print()
    print("batch 1's steps with the gate (medians; rest: worker start-up, the first task's wait,")
    print("the trip back; the steps' medians need not add up to batch 1's)")
    print("| " + " | ".join(STEPS) + " | batch 1 |")
    print("|" + "---:|" * (len(STEPS) + 1))
    m = med["gate"]
    print("| " + " | ".join(f"{m[k] * 1e3:.0f} ms" for k in STEPS) + f" | {m['batch_1_s'] * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
