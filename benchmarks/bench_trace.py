"""Provenance at scale: the cost of one ``samples_at`` lookup at 10^9 samples, and what the
delivery record (``record_keys=``) costs the loader's throughput. One process, side by side.

Part 1, lookups. A resume state deep into a run (3 spans: 1,024 ranks, then 512 after a resume,
then 768, and a skipped range of 10 steps), then ``trace_state(state, dataset, step, rank)``
(what ``stallfree trace`` does: parse the state, rebuild the order, place the step, compute the
batch's positions and indices, name them) at random steps in epochs 0-2 and random ranks,
each timed on its own; and ``loader.samples_at`` on a loader restored from that state:
  images : a real manifest of 200,000 tar shards x 5,000 samples = 10^9 (only the manifest is
           written; shard, row named; keys need each shard's index: not timed, no shards exist),
           the loader's order for it
  mixture: three sources of 4*10^8, 3*10^8, 3*10^8 virtual samples, a three-stage schedule, 10^9
           positions per epoch (source and index in the source named)
  tokens : packed windows of 32 tokens over 3.2 million virtual documents (10^9 windows; each
           window's documents and token offsets named), global order
  ints   : a virtual dataset of 10^9 samples, global order (positions and indices only)

Part 2, the delivery record. The same loader (a virtual dataset of ints, batch 256: the loader
does nothing but order, fetch, collate and ship, so any cost of the record shows at its largest)
over whole epochs with and without ``record_keys=``, interleaved, --repeats times each, in this
process; throughput is samples per second, and the figure is the ratio of medians (and of
the best runs), and the main process's CPU per batch (where the record runs; less sensitive
to a busy machine than wall time). Beside it, the record's own cost per batch where it runs (a recording
progress's ``on_batch`` minus a plain one's, timed over 20,000 batches) as a share of the
loader's time per batch: the end-to-end ratio on a busy machine is mostly noise.

  .venv/bin/python benchmarks/bench_trace.py --lookups 300 --record-samples 2000000 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import numpy as np

BATCH = 256


class Ints:
    """``n`` virtual samples; sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class VirtualTokens:
    """A token source of ``documents`` documents of 1,000 to 19,000 tokens (a fixed pattern),
    nothing stored: packing into windows and naming a window's documents need only the lengths."""

    name = "virtual-tokens"
    dtype = np.dtype("uint16")
    eos = None

    def __init__(self, documents: int) -> None:
        self.doc_lengths = 1000 + (np.arange(documents, dtype=np.int64) * 7919) % 18000

    @property
    def fingerprint(self) -> str:
        return f"virtual-{len(self.doc_lengths)}"

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.zeros(stop - start, self.dtype)


def write_manifest(root: str, shards: int, per_shard: int) -> None:
    """A tar manifest of ``shards`` shards (no shard files: opening reads only the manifest)."""
    path = os.path.join(root, "manifest.json")
    if os.path.exists(path):
        return
    os.makedirs(root, exist_ok=True)
    entries = [
        {
            "path": f"shard-{i:06d}.tar",
            "samples": per_shard,
            "bytes": per_shard * 110_000,
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
    with open(path, "w") as f:
        f.write(json.dumps(body) + "\n")


def deep_state(loader: Any) -> dict[str, Any]:
    """A state of ``loader``'s run at about 2.3 epochs: three spans and one skip."""
    from stallfree.loader.epoch.timeline import Span, Timeline

    n = len(loader.dataset)
    t = Timeline(n).extend(Span(0, 0, 0, 1024, BATCH))
    at1 = t.place(2500)  # a resume on 512 ranks at step 2500
    t = t.extend(Span(2500, at1.epoch, at1.start + at1.batch * 1024 * BATCH, 512, BATCH))
    p = t.place(9000)
    at = Span(9000, p.epoch, p.start + p.batch * 512 * BATCH, 512, BATCH)
    t = t.with_skip(9100, 9110, at=at)
    p = t.place(11000)
    last = Span(11000, p.epoch, p.start + p.batch * 512 * BATCH, 768, BATCH)
    t = t.extend(last)
    state = loader.state_dict()
    state.update(epoch=last.epoch, consumed=last.start, step=last.step, world_size=768, **t.to_state())
    return state


def time_lookups(name: str, dataset: Any, lookups: int, seed: int) -> dict[str, Any]:
    from stallfree.loader.dataloader import DataLoader
    from stallfree.loader.epoch.samples import trace_state

    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, seed=1, world=(0, 768))
    state = deep_state(loader)
    loader.load_state_dict(state)
    draw = random.Random(seed)
    last_step = state["step"] + 8000  # past the state too: its run extrapolated
    steps = [(draw.randrange(0, last_step), draw.randrange(0, 512)) for _ in range(lookups)]
    trace_state(state, dataset, 1, 0, keys=False)  # warm imports and the schedule's first segment
    cold, warm = [], []
    for step, rank in steps:
        t0 = time.perf_counter()
        found = trace_state(state, dataset, step, rank, keys=False)
        cold.append(time.perf_counter() - t0)
        assert len(found.samples) == BATCH
        t0 = time.perf_counter()
        loader.samples_at(step, rank, keys=False)
        warm.append(time.perf_counter() - t0)
    named = found.samples[0].to_dict()
    ms = sorted(x * 1e3 for x in cold)
    ms2 = sorted(x * 1e3 for x in warm)
    return {
        "dataset": name,
        "n": len(dataset),
        "order": state["order"],
        "lookups": lookups,
        "trace_state_ms_median": statistics.median(ms),
        "trace_state_ms_p99": ms[int(0.99 * (len(ms) - 1))],
        "samples_at_ms_median": statistics.median(ms2),
        "samples_at_ms_p99": ms2[int(0.99 * (len(ms2) - 1))],
        "a_sample": named,
    }


def throughput(n: int, record: str | None, workers: int) -> tuple[float, float]:
    """(samples per wall second, main-process CPU microseconds per batch) over one epoch."""
    from stallfree.loader.dataloader import DataLoader

    dl = DataLoader(Ints(n), batch_size=BATCH, shuffle=True, seed=2, num_workers=workers, record_keys=record)
    it = iter(dl)
    next(it)  # workers up: the first batch is not the record's cost
    t0, c0 = time.perf_counter(), time.process_time()
    count = BATCH
    for batch in it:
        count += len(batch)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    dl.close()
    batches = (count - BATCH) / BATCH
    return (count - BATCH) / elapsed, cpu / batches * 1e6


def record_cost_us(batches: int = 20000) -> dict[str, float]:
    """What the record adds per batch where it runs (the consumer's thread, on each received
    batch): ``on_batch`` of a recording progress minus a plain one, microseconds."""
    from stallfree.loader.epoch.order import RankShare, Shuffled
    from stallfree.loader.epoch.progress import EpochProgress
    from stallfree.loader.epoch.record import Begin, EpochRecorder, RecordedProgress, RecordWriter

    n = batches * BATCH
    with tempfile.TemporaryDirectory() as keys:
        writer = RecordWriter(keys, 0)
        share = RankShare(Shuffled(1, 0, n), 0, 0, 1)
        times = {}
        for name in ("plain", "recorded", "plain2", "recorded2"):
            if name.startswith("plain"):
                progress = EpochProgress(0, "positions", planned=n, samples=n)
            else:
                rec = EpochRecorder(writer, share, BATCH, Begin(0, 1, 0, 0, 0, n, 0, BATCH, "pad", False))
                progress = RecordedProgress(
                    0, "positions", planned=n, samples=n, recorder=rec, batch_size=BATCH
                )
            t0 = time.perf_counter()
            for seq in range(batches):
                progress.on_batch(BATCH, seq)
            times[name] = (time.perf_counter() - t0) / batches * 1e6
        writer.close()
    plain = min(times["plain"], times["plain2"])
    recorded = min(times["recorded"], times["recorded2"])
    return {
        "on_batch_us_plain": plain,
        "on_batch_us_recorded": recorded,
        "record_us_per_batch": recorded - plain,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lookups", type=int, default=300)
    ap.add_argument("--record-samples", type=float, default=2e6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--manifest-dir", default=os.path.join(tempfile.gettempdir(), "stallfree-bench-trace"))
    ap.add_argument("--skip-lookups", action="store_true")
    ap.add_argument("--skip-record", action="store_true")
    args = ap.parse_args()
    import stallfree
    from stallfree.shards.open import open_dataset

    if not args.skip_lookups:
        root = os.path.join(args.manifest_dir, "manifest-200000")
        write_manifest(root, 200_000, 5_000)
        images = open_dataset(root)
        schedule = stallfree.mix.stages(
            [
                (0, {"web": 0.8, "code": 0.2, "math": 0.0}),
                (4 * 10**8, {"web": 0.5, "code": 0.3, "math": 0.2}),
                (9 * 10**8, {"web": 0.2, "code": 0.3, "math": 0.5}),
            ]
        )
        mixture = stallfree.mix(
            {"web": Ints(4 * 10**8), "code": Ints(3 * 10**8), "math": Ints(3 * 10**8)},
            schedule,
            samples_per_epoch=10**9,
        )
        # 10^9 windows of 32 tokens: 3.2 * 10^10 tokens in 3.2 million documents of ~10,000
        tokens = stallfree.TokenDataset(VirtualTokens(3_201_000), 32)
        assert len(tokens) >= 10**9, len(tokens)
        sets = (("images", images), ("mixture", mixture), ("tokens", tokens), ("ints", Ints(10**9)))
        for name, ds in sets:
            row = time_lookups(name, ds, args.lookups, seed=7)
            print(json.dumps(row))
    if args.skip_record:
        return
    cost = record_cost_us()
    print(json.dumps({k: round(v, 2) for k, v in cost.items()}))
    n = int(args.record_samples)
    for workers in args.workers:
        runs: dict[str, list[float]] = {"off": [], "on": []}
        cpu: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory() as keys:
                for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    rate, us = throughput(n, keys if mode == "on" else None, workers)
                    runs[mode].append(rate)
                    cpu[mode].append(us)
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
        us_per_batch = BATCH / off * 1e6  # the loader's wall time per batch without the record
        print(
            json.dumps(
                {
                    "record_keys": "throughput",
                    "num_workers": workers,
                    "samples": n,
                    "off_samples_per_s": round(off),
                    "on_samples_per_s": round(on),
                    "on_over_off": round(on / off, 4),
                    "main_cpu_us_per_batch_off": round(cpu_off, 1),
                    "main_cpu_us_per_batch_on": round(cpu_on, 1),
                    "main_cpu_on_over_off": round(cpu_on / cpu_off, 4),
                    # each round runs both, back to back: the median of the rounds' own ratios
                    "paired_cpu_ratio_median": round(
                        statistics.median(a / b for a, b in zip(cpu["on"], cpu["off"], strict=True)), 4
                    ),
                    "paired_wall_ratio_median": round(
                        statistics.median(a / b for a, b in zip(runs["on"], runs["off"], strict=True)), 4
                    ),
                    "best_on_over_best_off": round(max(runs["on"]) / max(runs["off"]), 4),
                    "loader_us_per_batch": round(us_per_batch, 1),
                    "record_share_of_batch": round(cost["record_us_per_batch"] / us_per_batch, 5),
                    "runs_off": [round(x) for x in runs["off"]],
                    "runs_on": [round(x) for x in runs["on"]],
                }
            )
        )


if __name__ == "__main__":
    main()
