"""Start-up of the image loader: the first batches, made three ways.

The same loader as ``bench_peers.py``'s ours-cpu / ours-auto (``stallfree.DataLoader`` over the
peer bench's tar shards, ``ImageDecode(train=True, size=224, dtype="uint8")``, batch 64, 2
workers, persistent, shuffled), built from nothing each round, in one process, rounds rotating
which way goes first:

  inline  : as shipped (``loader/first_batch_inline.py``: the main process reads and decodes the pool's
            first batch on every core, then the workers fork)
  gate    : the first batch made by a worker (what a loader with a ``worker_init_fn`` gets):
            ``loader/worker/first_batch_gate.py``, it decodes on every worker's cores while the other
            workers hold their first decode for it
  no-gate : neither (every worker decodes its first batch on its own share of the cores)

Per round: seconds from building the loader to batches 1, 2, 3, 4, 8 and 9 (medians over rounds),
and the main process's CPU to the first batch. A second table splits the first batch into its
steps: ``iter()`` (the pool's queues, shared arrays and forks; inline, the first batch's read and
decode as well), the read, decode and collate of the first batch (the timers of whoever made it,
as ``loader.stats()["stages_s"]`` holds them when batch 1 is handed over), the main process's
transfer (adopting the slot, materialising the batch), and the rest: worker start-up, waiting for
the first task, and the result's trip to the main process. ``--parent-mib`` makes the main process
that much bigger first (resident pages), as a training process or ``bench_peers.py``'s (~750 MB by
our runners' turn) is: fork copies its page tables. The data is the peer bench's: run
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
from stallfree.loader import pool as engine

MARKS = (1, 2, 3, 4, 8, 9)
STEPS = ("iter_s", "read_s", "decode_s", "collate_s", "transfer_s", "rest_s")


VARIANTS = ("inline", "gate", "no-gate")


def one_round(shards: str, backend: str, variant: str, workers: int) -> dict[str, float]:
    real_gate, real_inline = engine.FirstBatchGate, engine.inline_first.runs_inline
    if variant != "inline":
        engine.inline_first.runs_inline = lambda _plan: False  # type: ignore[assignment]
    if variant == "no-gate":
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
        engine.FirstBatchGate = real_gate  # type: ignore[misc]
        engine.inline_first.runs_inline = real_inline  # type: ignore[assignment]


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
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    one_round(args.dir, args.backend, "inline", args.workers)  # page cache and imports warm for all
    for r in range(args.rounds):
        k = r % len(VARIANTS)
        for name in VARIANTS[k:] + VARIANTS[:k]:
            runs[name].append(one_round(args.dir, args.backend, name, args.workers))
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
    for other in ("gate", "no-gate"):
        ratio = " | ".join(f"{med['inline'][f'batch_{k}_s'] / med[other][f'batch_{k}_s']:.2f}" for k in MARKS)
        print(f"| inline / {other} | {ratio} | |")
    print()
    print("batch 1's steps (medians; rest: worker start-up, the first task's wait, the trip back;")
    print("the steps' medians need not add up to batch 1's)")
    print("| loader | " + " | ".join(STEPS) + " | batch 1 |")
    print("|---|" + "---:|" * (len(STEPS) + 1))
    for name, m in med.items():
        cells = " | ".join(f"{m[k] * 1e3:.0f} ms" for k in STEPS)
        print(f"| {name} | {cells} | {m['batch_1_s'] * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
