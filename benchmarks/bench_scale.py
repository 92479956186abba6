"""Epoch order at web scale: n = 10^6 .. 10^10 samples, shuffle on, 1 and 1,024 simulated ranks.

Per (runner, n, ranks), in a fresh process (so peaks and start-up are its own):
  first_batch_s : iterator created -> first batch of 256 in hand (the epoch's order is built here)
  peak_rss_mb   : peak RSS summed over the process tree (main + loader workers), sampled every 10 ms
  order_us_per_1k: CPU microseconds to compute 1,000 indices of the rank's share in steady state
                   (the order alone, batch by batch, after the first batch)
  loader_ms_per_batch, order_share: process-tree CPU per batch through the whole loader in steady
                   state, and the order's part of it (ours and torch; the samples are ints, so the
                   loader does nothing but order, fetch, collate and ship: the worst case for the share)
Runners:
  ours      : stallfree.DataLoader(ds, batch_size=256, shuffle=True, num_workers=2, world=(0, W))
  torch     : torch DataLoader(ds, batch_size=256, num_workers=2, sampler=DistributedSampler(ds, W, 0,
              shuffle=True)) (for W = 1: shuffle=True, torch's RandomSampler)
  streaming : MosaicML Streaming's epoch order as StreamingDataset computes it (get_partitions
              'relaxed' over all ranks, get_shuffle 'py1e' over shards of 10,000 samples, block
              262,144), then rank 0's first batch; no dataset is written (at 10^8 samples that
              would be terabytes), so it has no loader columns. Optional: pip install
              mosaicml-streaming (only its numpy-only shuffle and partition modules are loaded).
Peers are skipped where their order arrays would not fit in --mem-gib (said in the output):
torch needs an int64 permutation plus a Python list of n ints (~44 bytes each), Streaming about
three int64 arrays of n.

  .venv/bin/python benchmarks/bench_scale.py --n 1e6 1e8 1e9 1e10 --ranks 1 1024 --repeats 3
  .venv/bin/python benchmarks/bench_scale.py --manifest 200000 --repeats 3   (opening 10^9 samples' manifest)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

BATCH = 256
MIN_STEADY = 50  # batches: a rank's share shorter than this has no steady state to time


class Ints:
    """A map-style dataset of ``n`` samples whose sample ``i`` is ``i`` (nothing stored)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class PeakRss:
    """Largest RSS of this process plus its descendants, sampled on a thread."""

    def __init__(self, interval: float = 0.01) -> None:
        import psutil

        self._proc, self._psutil = psutil.Process(), psutil
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        total = self._proc.memory_info().rss
        for child in self._proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except self._psutil.Error:
                continue
        self.peak = max(self.peak, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.sample()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak


def _tree_cpu() -> float:
    from stallfree.harness.metrics import process_tree_cpu_seconds

    return process_tree_cpu_seconds()


def _steady_loader(it: Any, batches: int) -> float | None:
    """Process-tree CPU seconds per batch over the next ``batches`` batches (None: the share is
    too short to have a steady state)."""
    if batches < MIN_STEADY:
        return None
    next(it)  # workers warm
    c0 = _tree_cpu()
    for _ in range(batches):
        next(it)
    return (_tree_cpu() - c0) / batches


def _steady_order(plan: Any, batches: int) -> float | None:
    """CPU seconds per batch of the order alone over ``batches`` batches after the first."""
    if batches < MIN_STEADY:
        return None
    plan = iter(plan)
    next(plan)
    gc.collect()
    c0 = time.process_time()
    for _ in range(batches):
        next(plan)
    return (time.process_time() - c0) / batches


def _row(first_s: float, peak: int, order_s: float | None, per_batch: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"first_batch_s": first_s, "peak_rss_mb": peak / 2**20}
    if order_s is not None:
        row["order_us_per_1k"] = order_s / BATCH * 1e3 * 1e6
    if per_batch is not None:
        row["loader_ms_per_batch"] = per_batch * 1e3
        if order_s is not None and per_batch > 0:
            row["order_share"] = order_s / per_batch
    return row


def run_ours(n: int, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    import stallfree
    from stallfree.loader.epoch import order as order_mod

    rss = PeakRss()
    dl = stallfree.DataLoader(
        Ints(n), batch_size=BATCH, shuffle=True, num_workers=args.workers, seed=0, world=(0, ranks)
    )
    t0 = time.perf_counter()
    it = iter(dl)
    first = next(it)
    first_s = time.perf_counter() - t0
    per_batch = _steady_loader(it, min(args.steady, len(dl) - 2))
    peak = rss.stop()
    del it
    # the order alone, as the loader computes it: one rank's share, batch after batch
    share = order_mod.RankShare(order_mod.make_order(0, 0, n), 0, 0, ranks)
    plan = order_mod.batches(share, BATCH, False)
    order_s = _steady_order(plan, min(args.order_batches, len(plan) - 1))
    assert len(first) == BATCH
    return _row(first_s, peak, order_s, per_batch)


def run_torch(n: int, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    rss = PeakRss()
    ds = Ints(n)
    if ranks == 1:
        dl = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=args.workers)
    else:
        sampler = DistributedSampler(ds, num_replicas=ranks, rank=0, shuffle=True, seed=0)
        dl = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=args.workers)
    t0 = time.perf_counter()
    it = iter(dl)
    first = next(it)
    first_s = time.perf_counter() - t0
    per_batch = _steady_loader(it, min(args.steady, len(dl) - 2))
    peak = rss.stop()
    del it
    # the order alone: the batch sampler's next batches, after the first (which built the epoch)
    plan = BatchSampler(dl.sampler, BATCH, False)
    order_s = _steady_order(plan, min(args.order_batches, len(plan) - 1))
    assert len(first) == BATCH and torch.is_tensor(first)
    return _row(first_s, peak, order_s, per_batch)


def _streaming_modules() -> tuple[Any, Any]:
    """Streaming's shuffle and partition modules without its package ``__init__`` (which imports
    transformers, boto3, ... for the dataset classes): they need numpy only."""
    import importlib
    import importlib.util
    import types

    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mosaicml-streaming is not installed (pip install mosaicml-streaming)")
    root = list(spec.submodule_search_locations)[0]
    for name, path in (("streaming", root), ("streaming.base", os.path.join(root, "base"))):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [path]
            sys.modules[name] = mod
    return (
        importlib.import_module("streaming.base.shuffle"),
        importlib.import_module("streaming.base.partition"),
    )


def run_streaming(n: int, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    shuffle, partition = _streaming_modules()
    rss = PeakRss()
    t0 = time.perf_counter()
    shard = 10_000
    sizes = np.full(n // shard, shard, np.int64)
    if n % shard:
        sizes = np.append(sizes, n % shard)
    nodes, per_node = (1, 1) if ranks == 1 else (ranks // 8, 8)
    ids = partition.get_partitions("relaxed", n, nodes, nodes, per_node, args.workers, BATCH, 0)
    big = shuffle.get_shuffle("py1e", sizes, nodes, 0, 0, 1 << 18)
    mine = ids[0, 0].reshape(-1)  # rank 0's part: all its workers' batches
    first = np.where(mine[:BATCH] == -1, -1, big[mine[:BATCH]])
    first_s = time.perf_counter() - t0
    k = min(args.order_batches, len(mine) // BATCH - 1)
    c0 = time.process_time()
    for b in range(1, k + 1):
        part = mine[b * BATCH : (b + 1) * BATCH]
        np.where(part == -1, -1, big[part])
    order_s = (time.process_time() - c0) / k if k >= MIN_STEADY else None
    peak = rss.stop()
    assert len(first) == BATCH
    return _row(first_s, peak, order_s, None)


def run_manifest(shards: int, _ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """open_dataset on a manifest of ``shards`` shards of 5,000 samples (written once into
    --manifest-dir; only the manifest: opening reads no shard), its fingerprint (once computed,
    then cached), and beside it the fingerprint as it was computed before manifest_rows (json.dumps
    of a dict per shard), in the same process."""
    import hashlib
    import resource

    import psutil

    from stallfree.shards.open import open_dataset

    root = os.path.join(args.manifest_dir, f"manifest-{shards}")
    if not os.path.exists(os.path.join(root, "manifest.json")):
        os.makedirs(root, exist_ok=True)
        entries = [
            {
                "path": f"shard-{i:06d}.tar",
                "samples": 5000,
                "bytes": 5000 * 110_000,
                "sha256": hashlib.sha256(str(i).encode()).hexdigest(),
            }
            for i in range(shards)
        ]
        body = {
            "version": 1,
            "format": "tar",
            "fields": ["jpg", "cls"],
            "classes": None,
            "skipped": [],
            "shards": entries,
        }
        with open(os.path.join(root, "manifest.json"), "w") as f:
            f.write(json.dumps(body, indent=1) + "\n")
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    ds = open_dataset(root)
    t1 = time.perf_counter()
    fp = ds.fingerprint
    t2 = time.perf_counter()
    again = ds.fingerprint
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    m = ds.manifest
    t4 = time.perf_counter()
    body = {
        "version": m.version,
        "format": m.format,
        "fields": m.fields,
        "shards": [s.to_json() for s in m.shards],
    }
    old = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    t5 = time.perf_counter()
    assert old == fp == again and len(ds) == shards * 5000 and ds.locate(len(ds) - 1) == (shards - 1, 4999)
    return {
        "open_s": t1 - t0,
        "fingerprint_s": t2 - t1,
        "fingerprint_again_s": t3 - t2,
        "fingerprint_before_s": t5 - t4,
        "peak_delta_mb": (peak - before) / 2**20,
        "manifest_mb": os.path.getsize(os.path.join(root, "manifest.json")) / 2**20,
    }


RUNNERS = {"ours": run_ours, "torch": run_torch, "streaming": run_streaming, "manifest": run_manifest}


def needed_gib(runner: str, n: int) -> float:
    """What the runner's order arrays alone take (see the module docstring)."""
    if runner == "torch":
        return n * (8 + 8 + 36) / 2**30  # randperm int64, list of pointers, int objects
    if runner == "streaming":
        return n * 8 * 3 / 2**30
    return 0.0


def one(runner: str, n: int, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        runner,
        str(n),
        str(ranks),
        "--workers",
        str(args.workers),
        "--steady",
        str(args.steady),
        "--order-batches",
        str(args.order_batches),
        "--manifest-dir",
        args.manifest_dir,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", nargs="+", type=float, default=[1e6, 1e8, 1e9])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 1024])
    ap.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steady", type=int, default=300, help="batches timed through the loader")
    ap.add_argument("--order-batches", type=int, default=2048, help="batches of the order alone timed")
    ap.add_argument("--mem-gib", type=float, default=20.0, help="skip a peer whose order needs more")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--manifest",
        type=int,
        default=0,
        metavar="SHARDS",
        help="only time opening a manifest of SHARDS shards",
    )
    ap.add_argument("--manifest-dir", default="/tmp/stallfree-bench-scale", help="where --manifest writes it")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", nargs=3, metavar=("RUNNER", "N", "RANKS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        runner, n, ranks = args.one[0], int(float(args.one[1])), int(args.one[2])
        print(json.dumps(RUNNERS[runner](n, ranks, args)))
        return
    if args.manifest:
        runs = [one("manifest", args.manifest, 1, args) for _ in range(args.repeats)]
        good = [r for r in runs if "error" not in r]
        if not good:
            print(f"manifest ERROR {runs[0]['error']}")
            return
        med = {k: statistics.median(r[k] for r in good) for k in good[0]}
        print(json.dumps(med) if args.json else "  ".join(f"{k} {v:.3f}" for k, v in med.items()))
        return
    rows = []
    for n in (int(x) for x in args.n):
        for ranks in args.ranks:
            for runner in args.runners:
                need = needed_gib(runner, n)
                if need > args.mem_gib:
                    rows.append(
                        {"runner": runner, "n": n, "ranks": ranks, "skipped": f"needs ~{need:.0f} GiB"}
                    )
                    continue
                if runner == "streaming" and ranks > 1 and ranks % 8:
                    rows.append({"runner": runner, "n": n, "ranks": ranks, "skipped": "ranks not 8 per node"})
                    continue
                runs = [one(runner, n, ranks, args) for _ in range(args.repeats)]
                good = [r for r in runs if "error" not in r]
                row: dict[str, Any] = {"runner": runner, "n": n, "ranks": ranks, "runs": len(good)}
                if not good:
                    row["error"] = runs[0]["error"]
                for key in (
                    "first_batch_s",
                    "peak_rss_mb",
                    "order_us_per_1k",
                    "loader_ms_per_batch",
                    "order_share",
                ):
                    vals = [r[key] for r in good if key in r]
                    if vals:
                        row[key] = statistics.median(vals)
                rows.append(row)
                print(json.dumps(row) if args.json else _line(row), flush=True)
    if not args.json:
        print(
            "\nskipped: "
            + "; ".join(
                f"{r['runner']} n={r['n']:.0e} ranks={r['ranks']}: {r['skipped']}"
                for r in rows
                if "skipped" in r
            )
        )


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['runner']:9s} n={row['n']:.0e} ranks={row['ranks']:5d}  ERROR {row['error']}"
    parts = [f"{row['runner']:9s} n={row['n']:.0e} ranks={row['ranks']:5d}"]
    parts.append(f"first {row['first_batch_s']:8.3f} s  peak {row['peak_rss_mb']:8.0f} MiB")
    if "order_us_per_1k" in row:
        parts.append(f"order {row['order_us_per_1k']:8.1f} us/1k")
    if "loader_ms_per_batch" in row:
        parts.append(f"loader {row['loader_ms_per_batch']:6.2f} ms/batch")
    if "order_share" in row:
        parts.append(f"order share {100 * row['order_share']:5.2f}%")
    return "  ".join(parts)


if __name__ == "__main__":
    main()
