"""What the loader adds on top of the decode it runs: the same decode, in a loop vs through the loader.

Both sides do the same work on the same samples with the same core count:
  loop   : ``ImageDecode.decode_batch`` over batches of samples already in memory, on
           ``--workers`` threads (the decoder's own thread pool), no loader at all;
  loader : ``stallfree.DataLoader(open_dataset(shards), num_workers=--workers, decode=ImageDecode(...))``,
           which also reads the samples from the tar shards, ships batches through shared memory
           and assembles them in the main process.
The overhead is loader CPU ms per image over loop CPU ms per image, minus one (whole process tree,
so worker processes count). Rounds alternate the order; medians are reported.

  .venv/bin/python benchmarks/bench_loader_overhead.py --dir /tmp/peers-data/shards --rounds 5
(any directory of tar shards with JPEGs works; benchmarks/bench_peers.py writes an ImageNet-like one)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from stallfree.gpu_decode.select import ImageDecode
from stallfree.harness.metrics import process_tree_cpu_seconds
from stallfree.loader.dataloader import DataLoader
from stallfree.shards.open import open_dataset


def run_loop(samples: list[dict], args: argparse.Namespace, seed: int) -> tuple[float, float]:
    dec = ImageDecode(train=True, size=args.size, dtype=args.dtype, backend="cpu", num_threads=args.workers)
    dec.decode_batch(samples[: args.batch], seed=seed)  # thread pool started, buffers made
    c0, t0 = process_tree_cpu_seconds(), time.perf_counter()
    n = 0
    for start in range(0, len(samples) - args.batch + 1, args.batch):
        n += len(dec.decode_batch(samples[start : start + args.batch], seed=seed + start)["__key__"])
    wall, cpu = time.perf_counter() - t0, process_tree_cpu_seconds() - c0
    dec.close()
    return cpu / n * 1e3, n / wall


def run_loader(url: str, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    dec = ImageDecode(train=True, size=args.size, dtype=args.dtype, backend="cpu")
    loader = DataLoader(
        open_dataset(url),
        batch_size=args.batch,
        shuffle=True,
        seed=seed,
        num_workers=args.workers,
        persistent_workers=True,
        decode=dec,
        drop_last=True,
    )
    it = iter(loader)
    next(it)  # workers started and warm, as the loop's first batch
    c0, t0 = process_tree_cpu_seconds(), time.perf_counter()
    n = 0
    for batch in it:
        n += len(batch["__key__"])
    wall, cpu = time.perf_counter() - t0, process_tree_cpu_seconds() - c0
    del it, loader
    return cpu / n * 1e3, n / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory of tar shards of JPEG samples")
    ap.add_argument(
        "--images", type=int, default=2048, help="samples per round (the loop holds them in memory)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--dtype", default="uint8", choices=["uint8", "float32"])
    ap.add_argument("--json", help="write the per-round figures here")
    args = ap.parse_args()

    ds = open_dataset(args.dir)
    n = min(args.images, len(ds))
    samples = [ds[i] for i in range(n)]
    # the loader reads the same n samples: a subset directory is not needed, the epoch just runs on
    # the whole data set, and per-image figures compare like for like
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = ["loop", "loader"] if r % 2 == 0 else ["loader", "loop"]
        row: dict = {}
        for name in order:
            ms, ips = run_loop(samples, args, r) if name == "loop" else run_loader(args.dir, args, r)
            row[name] = {"cpu_ms_per_image": ms, "images_per_s": ips}
        row["overhead"] = row["loader"]["cpu_ms_per_image"] / row["loop"]["cpu_ms_per_image"] - 1
        rounds.append(row)
        print(
            f"round {r}: loop {row['loop']['cpu_ms_per_image']:.3f} ms/img ({row['loop']['images_per_s']:.0f} img/s)"
            f"  loader {row['loader']['cpu_ms_per_image']:.3f} ms/img ({row['loader']['images_per_s']:.0f} img/s)"
            f"  overhead {row['overhead']:+.1%}",
            flush=True,
        )
    med = {k: statistics.median(r[k]["cpu_ms_per_image"] for r in rounds) for k in ("loop", "loader")}
    print()
    print(
        f"| {args.dtype}, {args.workers} cores | CPU ms / image (median of {args.rounds}) | img/s (median) |"
    )
    print("|---|---:|---:|")
    for k in ("loop", "loader"):
        print(f"| {k} | {med[k]:.3f} | {statistics.median(r[k]['images_per_s'] for r in rounds):.0f} |")
    print(
        f"| loader overhead | {med['loader'] / med['loop'] - 1:+.1%} (median of rounds: "
        f"{statistics.median(r['overhead'] for r in rounds):+.1%}) | |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
