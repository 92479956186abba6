"""What the checked remote read costs: ``shards.remote`` against the raw fsspec calls it wraps.

Reads the same sample spans both ways in this one process, rounds interleaved (order reversed
every other round; best round counts: shared, noisy machine):
  memory   in-memory fsspec storage, no network: the primitive's own cost per call, isolated
           (``fs.cat_file`` vs ``remote.read_range``; CPU time of this thread)
  single   over the loopback HTTP server (``stallfree.testing.httpserve``), one sample span per
           request: ``fs.cat_file(path, start=, end=)`` (what ``readers.py`` called before) vs
           ``remote.read_range``
  batch    32 random samples per call, coalesced per shard: ``fs.cat_ranges`` vs
           ``remote.read_ranges``
  arrow    every record batch of the Arrow shards through ``pa.PythonFile`` over fsspec's file
           (``cache_type="none"``, what ``ArrowShardReader`` used) vs over ``remote.RangeFile``
Reports requests/s (wall) and CPU ms per request (this process: the in-process server's threads
too, except for ``memory``); ratios are checked/raw (1.00: no cost).

    .venv/bin/python benchmarks/bench_remote_read.py --samples 2000 --sample-kb 100 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

import fsspec

from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.storage import remote
from stallfree.storage.ranges import coalesce
from stallfree.testing.httpserve import serve_directory


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _write(root: Path, n: int, kb: int) -> None:
    rng = random.Random(0)
    for fmt in ("tar", "arrow"):
        with ShardWriter(str(root / fmt), format=fmt, max_samples=max(1, n // 4)) as w:
            for i in range(n):
                w.write({"__key__": f"s{i:06d}", "bin": rng.randbytes(kb * 1024), "cls": i % 10})


def _spans(ds) -> list[tuple[str, int, int]]:
    out = []
    for s, size in enumerate(ds.shard_sizes):
        reader = ds._reader(s)  # the benchmark reads the reader's own spans
        out += [(ds.shard_path(s), *reader.span(r)) for r in range(size)]
    return out


def _timed(fn, count: int, thread_cpu: bool = False) -> tuple[float, float]:
    clock = time.thread_time if thread_cpu else _cpu
    t0, c0 = time.perf_counter(), clock()
    fn()
    wall, cpu = time.perf_counter() - t0, clock() - c0
    return count / wall, cpu / count * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--sample-kb", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        root = Path(tmp)
        _write(root, args.samples, args.sample_kb)
        with serve_directory(root) as server:
            fs = fsspec.filesystem("http", skip_instance_cache=True)
            ds = open_dataset(f"{server.url}/tar")
            spans = _spans(ds)
            rng = random.Random(1)
            order = rng.sample(spans, len(spans))
            batches = []
            for i in range(0, len(order), 32):
                by_path: dict[str, list] = {}
                for path, a, b in order[i : i + 32]:
                    by_path.setdefault(path, []).append((a, b, len(by_path.get(path, []))))
                batches += [(p, [(g[0], g[1]) for g in coalesce(v)]) for p, v in by_path.items()]
            n_batch_req = sum(len(r) for _, r in batches)
            arrow = open_dataset(f"{server.url}/arrow")
            arrow_files = [
                (arrow.shard_path(s), arrow._reader(s).size) for s in range(len(arrow.shard_sizes))
            ]
            n_arrow = sum(arrow.shard_sizes)

            def single_raw():
                for path, a, b in order:
                    fs.cat_file(path, start=a, end=b)

            def single_checked():
                for path, a, b in order:
                    remote.read_range(fs, path, a, b, shard="s")

            def batch_raw():
                for path, ranges in batches:
                    fs.cat_ranges([path] * len(ranges), [r[0] for r in ranges], [r[1] for r in ranges])

            def batch_checked():
                for path, ranges in batches:
                    remote.read_ranges(fs, path, ranges, shard="s")

            def arrow_read(make):
                import pyarrow as pa
                import pyarrow.ipc as ipc

                for path, size in arrow_files:
                    reader = ipc.open_file(pa.PythonFile(make(path, size), mode="r"))
                    for b in range(reader.num_record_batches):
                        reader.get_batch(b)

            def arrow_raw():
                arrow_read(lambda p, size: fs.open(p, "rb", block_size=1 << 20, cache_type="none", size=size))

            def arrow_checked():
                arrow_read(lambda p, size: remote.RangeFile(fs, p, size, shard="s"))

            mem = fsspec.filesystem("memory")
            blob = bytes(args.sample_kb * 1024 * 8)
            mem.pipe("/bench-remote/a.bin", blob)
            step = args.sample_kb * 1024
            mem_spans = [(i * step, (i + 1) * step) for i in range(8)] * 500

            def memory_raw():
                for a, b in mem_spans:
                    mem.cat_file("/bench-remote/a.bin", start=a, end=b)

            def memory_checked():
                for a, b in mem_spans:
                    remote.read_range(mem, "/bench-remote/a.bin", a, b, shard="a.bin")

            cases = {
                "memory": (memory_raw, memory_checked, len(mem_spans)),
                "single": (single_raw, single_checked, len(order)),
                "batch": (batch_raw, batch_checked, n_batch_req),
                "arrow": (arrow_raw, arrow_checked, n_arrow),
            }
            best: dict[str, dict[str, tuple[float, float]]] = {k: {} for k in cases}
            for rnd in range(args.rounds):
                for name, (raw, checked, count) in cases.items():
                    pair = [("raw", raw), ("checked", checked)]
                    for label, fn in pair if rnd % 2 == 0 else pair[::-1]:
                        rate, cpu = _timed(fn, count, thread_cpu=name == "memory")
                        old = best[name].get(label)
                        best[name][label] = (max(rate, old[0]), min(cpu, old[1])) if old else (rate, cpu)
    rows = []
    for name, got in best.items():
        (r_rate, r_cpu), (c_rate, c_cpu) = got["raw"], got["checked"]
        rows.append(
            {
                "case": name,
                "raw_per_s": round(r_rate),
                "checked_per_s": round(c_rate),
                "wall_ratio": round(r_rate / c_rate, 3),  # checked time / raw time
                "raw_cpu_ms": round(r_cpu, 4),
                "checked_cpu_ms": round(c_cpu, 4),
                "cpu_ratio": round(c_cpu / r_cpu, 3),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        "| case | raw req/s | checked req/s | time ratio (checked/raw) | CPU ms/req raw | checked | CPU ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['raw_per_s']} | {r['checked_per_s']} | {r['wall_ratio']:.2f} | "
            f"{r['raw_cpu_ms']} | {r['checked_cpu_ms']} | {r['cpu_ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
