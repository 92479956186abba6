"""Shard-time downscaling (``stallfree shard --max-side N``): CPU decode + RandomResizedCrop on
the original large JPEGs vs on the same data set downscaled at shard time.

DIFFERENT WORK. The downscaled run decodes and crops smaller images (the crops see fewer source
pixels), so its speed-up is not a same-work ratio and must never be counted in one; it says what
the FFCV-style trade buys, for each pipeline, and what it costs once at shard time.

Data: ``--images`` real-photo JPEGs of ``--width`` x ``--height`` (quality 90, 4:2:0), sharded as
they are and with ``--max-side``. Per-sample work, the same for every pipeline: decode +
RandomResizedCrop(224, scale 0.08-1, ratio 3/4-4/3, antialiased) + random flip, uint8 CHW out,
stacked in batches of ``--batch-size``, one thread each (torch intra-op threads 1). Pipelines:
  torchvision : PIL decode + torchvision.transforms.v2 on the PIL image
  simplejpeg  : simplejpeg decode + transforms.v2 on the tensor
  ours        : stallfree ImageDecode(backend="cpu", dtype="uint8", num_threads=1)
Rounds interleave every (pipeline, data set) pair, the order reversed every other round; the
table gives the median round's images/s and CPU ms per image (this process's CPU time).

Needs torchvision and simplejpeg, which stay out of the library's environment:
  .venv-bench/bin/python benchmarks/bench_max_side.py --images 1000 --max-side 320 --rounds 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from stallfree.gpu_decode.downscale import Downscale
from stallfree.gpu_decode.select import ImageDecode
from stallfree.shards.open import open_dataset
from stallfree.shards.parallel import shard_dataset
from stallfree.shards.sources.registry import open_source
from stallfree.testing.images import base_photos, encode_jpeg, make_image

Batch = list[dict]


def make_folder(root: Path, images: int, size: tuple[int, int], classes: int = 10) -> Path:
    rng = np.random.default_rng(0)
    photos = base_photos()
    for i in range(images):
        d = root / f"class_{i % classes:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img_{i:06d}.jpg").write_bytes(encode_jpeg(make_image(rng, photos, size), 90))
    return root


def _cpu_s() -> float:
    """This process's CPU time plus its reaped children's (the sharder's worker processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def shard(src: Path, dst: Path, workers: int, per_shard: int, transform: Downscale | None) -> dict:
    t0, c0 = time.perf_counter(), _cpu_s()
    summary = shard_dataset(
        open_source(src), str(dst), workers=workers, max_samples=per_shard, transform=transform
    )
    info = summary.to_json()
    info["wall_s"] = time.perf_counter() - t0
    info["cpu_s"] = _cpu_s() - c0
    return info


def load(dst: Path) -> list[dict]:
    return [
        {"__key__": s["__key__"], "jpg": bytes(s["jpg"]), "cls": int(s["cls"])}
        for s in open_dataset(str(dst))
    ]


def pipelines(size: int) -> dict[str, Callable[[Batch, int], int]]:
    """name -> run(batch, seed) producing a uint8 (N, 3, size, size) batch; returns N."""
    import simplejpeg
    import torchvision.transforms.v2 as T
    from PIL import Image

    tv = T.Compose([T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip(), T.PILToTensor()])
    tensor_ops = T.Compose([T.RandomResizedCrop(size, antialias=True), T.RandomHorizontalFlip()])

    def torchvision_run(batch: Batch, seed: int) -> int:
        torch.manual_seed(seed)
        return torch.stack([tv(Image.open(io.BytesIO(s["jpg"])).convert("RGB")) for s in batch]).shape[0]

    def simplejpeg_run(batch: Batch, seed: int) -> int:
        torch.manual_seed(seed)
        out = []
        for s in batch:
            hwc = simplejpeg.decode_jpeg(s["jpg"], colorspace="RGB")
            out.append(tensor_ops(torch.from_numpy(hwc).permute(2, 0, 1)))
        return torch.stack(out).shape[0]

    ours = ImageDecode(train=True, size=size, backend="cpu", dtype="uint8", device="cpu", num_threads=1)

    def ours_run(batch: Batch, seed: int) -> int:
        return ours.decode_batch(batch, seed=seed)["image"].shape[0]

    return {"torchvision": torchvision_run, "simplejpeg": simplejpeg_run, "ours": ours_run}


def timed(run: Callable[[Batch, int], int], batches: list[Batch], rnd: int) -> tuple[float, float, int]:
    t0, c0 = time.perf_counter(), time.process_time()
    n = sum(run(b, rnd * 100_003 + j) for j, b in enumerate(batches))
    return time.perf_counter() - t0, time.process_time() - c0, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=768)
    ap.add_argument("--max-side", type=int, default=320)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-workers", type=int, default=2)
    ap.add_argument("--shard-samples", type=int, default=100, help="samples per shard")
    ap.add_argument("--json", help="write results to this JSON file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="bench-max-side-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        make_folder(root / "src", args.images, (args.width, args.height))
        print(
            f"made {args.images} JPEGs of {args.width}x{args.height} in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
        sharded = {
            "original": shard(root / "src", root / "orig", args.shard_workers, args.shard_samples, None),
            f"max-side {args.max_side}": shard(
                root / "src",
                root / "small",
                args.shard_workers,
                args.shard_samples,
                Downscale(args.max_side, args.quality),
            ),
        }
        data = {"original": load(root / "orig"), f"max-side {args.max_side}": load(root / "small")}

    bs = args.batch_size
    batches = {name: [s[i : i + bs] for i in range(0, len(s), bs)] for name, s in data.items()}
    pipes = pipelines(args.size)
    pairs = [(p, d) for p in pipes for d in data]
    for p, d in pairs:  # warm up: imports, buffers, first-call costs
        pipes[p](batches[d][0], -1)
    rounds: dict[tuple[str, str], list[tuple[float, float, int]]] = {pair: [] for pair in pairs}
    for rnd in range(args.rounds):
        for p, d in pairs if rnd % 2 == 0 else reversed(pairs):
            rounds[(p, d)].append(timed(pipes[p], batches[d], rnd))
            print(
                f"round {rnd + 1}: {p:12s} {d:14s} {rounds[(p, d)][-1][2] / rounds[(p, d)][-1][0]:8.1f} img/s",
                file=sys.stderr,
            )

    results = []
    for (p, d), rs in rounds.items():
        ips = statistics.median(n / wall for wall, _, n in rs)
        cpu_ms = statistics.median(1e3 * cpu / n for _, cpu, n in rs)
        results.append({"pipeline": p, "data": d, "img_s": ips, "cpu_ms_per_image": cpu_ms, "rounds": rs})

    print("\n| data set | shard bytes | mean KB/image | resized | shard wall s | shard CPU ms/image |")
    print("|---|---:|---:|---:|---:|---:|")
    for d, info in sharded.items():
        resized = info.get("transform", {}).get("resized", "-")
        print(
            f"| {d} | {info['bytes']:,} | {info['bytes'] / info['samples'] / 1e3:.1f} | {resized} | "
            f"{info['wall_s']:.1f} | {1e3 * info['cpu_s'] / info['samples']:.2f} |"
        )
    base = {r["pipeline"]: r for r in results if r["data"] == "original"}
    print(
        "\n| pipeline | data set | img/s | CPU ms/image | vs the same pipeline on the originals: "
        "img/s | CPU per image |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        b = base[r["pipeline"]]
        ratios = (
            "- | -"
            if r is b
            else f"{r['img_s'] / b['img_s']:.2f}x | {b['cpu_ms_per_image'] / r['cpu_ms_per_image']:.2f}x less"
        )
        print(
            f"| {r['pipeline']} | {r['data']} | {r['img_s']:.1f} | {r['cpu_ms_per_image']:.2f} | {ratios} |"
        )
    print("(the ratios compare different work: the downscaled run decodes smaller images)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "shards": sharded, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
