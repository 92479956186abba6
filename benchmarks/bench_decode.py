"""Decode + augment throughput: torchvision-style CPU pipeline vs ours (CPU fallback, DALI CPU, DALI GPU).

Same JPEGs (real photographs at ImageNet-like sizes), same output (N x 3 x size x size float32,
ImageNet-normalised), same core count, one process run, rounds interleaved so machine noise hits
every pipeline alike. Reports images/s (best round), CPU cores used (process + worker CPU time /
wall time), images per CPU-second (what the decode costs in CPU, which other engineers' load on a
shared machine disturbs far less than wall time), and each pipeline's ratio to the best
torchvision-style baseline on both measures.

Baselines (PIL decode + torchvision.transforms RandomResizedCrop / RandomHorizontalFlip / ToTensor
/ Normalize, or Resize / CenterCrop for eval), both ways people run them:
  tv-threads : the per-image transform in a thread pool of --threads threads, torch.stack per batch
               (torch intra-op threads set to 1 meanwhile, so the baseline is not oversubscribed)
  tv-loader  : torch.utils.data.DataLoader(num_workers=--threads, persistent_workers=True)
Ours: stallfree.gpu_decode.ImageDecode(backend=...).decode_batch per batch.

Needs torchvision, which stays out of the library's environment: run in .venv-bench
  bash benchmarks/env.sh
  .venv-bench/bin/python benchmarks/bench_decode.py --images 256 --rounds 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from stallfree.gpu_decode.augment import IMAGENET_MEAN, IMAGENET_STD
from stallfree.gpu_decode.select import ImageDecode
from stallfree.harness.metrics import process_tree_cpu_seconds
from stallfree.testing.images import jpeg_bytes

IMAGENET_SIZES = ((500, 375), (375, 500), (500, 333), (640, 480), (800, 600), (1024, 683), (320, 240))


class TorchvisionStyle:
    """PIL + torchvision.transforms per image — what most PyTorch training scripts run."""

    def __init__(self, train: bool, size: int) -> None:
        import torchvision.transforms as T

        norm = T.Normalize([m / 255 for m in IMAGENET_MEAN], [s / 255 for s in IMAGENET_STD])
        if train:
            ops = [T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm]
        else:
            ops = [T.Resize(round(size / 0.875)), T.CenterCrop(size), T.ToTensor(), norm]
        self.transform = T.Compose(ops)

    def __call__(self, data: bytes) -> torch.Tensor:
        from PIL import Image

        return self.transform(Image.open(io.BytesIO(data)).convert("RGB"))


class _BytesDataset(torch.utils.data.Dataset):
    def __init__(self, datas: list[bytes], fn: TorchvisionStyle) -> None:
        self.datas, self.fn = datas, fn

    def __len__(self) -> int:
        return len(self.datas)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.fn(self.datas[i])


def check_crop_params(draws: int = 20000) -> None:
    """Print quantiles of our RandomResizedCrop boxes next to torchvision's own get_params."""
    import torchvision.transforms as T
    from PIL import Image

    from stallfree.gpu_decode.augment import random_resized_crop

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    q = [0.1, 0.5, 0.9]
    print("crop-box quantiles (10/50/90%), torchvision vs ours:")
    for w, h in [(500, 375), (1000, 1000), (1024, 200)]:
        img = Image.new("RGB", (w, h))
        tv = np.array(
            [T.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(draws)]
        )
        ours = np.array([random_resized_crop(w, h, rng) for _ in range(draws)])
        tv_area, ours_area = tv[:, 2] * tv[:, 3] / (w * h), ours[:, 2] * ours[:, 3] / (w * h)
        tv_ar, ours_ar = tv[:, 3] / tv[:, 2], ours[:, 2] / ours[:, 3]
        print(
            f"  {w}x{h}: area {np.round(np.quantile(tv_area, q), 3)} vs {np.round(np.quantile(ours_area, q), 3)}; "
            f"aspect {np.round(np.quantile(tv_ar, q), 3)} vs {np.round(np.quantile(ours_ar, q), 3)}"
        )


def make_pipelines(args: argparse.Namespace, datas: list[bytes]) -> dict[str, Callable[[int], int]]:
    """name -> run(round) decoding every image once in batches; returns images produced."""
    from concurrent.futures import ThreadPoolExecutor

    train, size, bs, threads = args.preset == "train", args.size, args.batch_size, args.threads
    batches = [datas[i : i + bs] for i in range(0, len(datas), bs)]
    pipes: dict[str, Callable[[int], int]] = {}

    tv = TorchvisionStyle(train, size)
    pool = ThreadPoolExecutor(threads)

    def tv_threads(_round: int) -> int:
        # One intra-op thread per pool thread, as DataLoader workers run: torch ops started from
        # several threads at once otherwise oversubscribe the cores and the baseline looks worse.
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            n = 0
            for batch in batches:
                n += torch.stack(list(pool.map(tv, batch))).shape[0]
        finally:
            torch.set_num_threads(before)
        return n

    pipes["tv-threads"] = tv_threads

    loader = torch.utils.data.DataLoader(
        _BytesDataset(datas, tv),
        batch_size=bs,
        num_workers=threads,
        persistent_workers=True,
        prefetch_factor=2,
    )
    list(loader)  # start the workers outside the timed rounds

    def tv_loader(_round: int) -> int:
        return sum(b.shape[0] for b in loader)

    pipes["tv-loader"] = tv_loader

    samples = [{"__key__": f"{i:06d}", "jpg": d, "cls": b"0"} for i, d in enumerate(datas)]
    sample_batches = [samples[i : i + bs] for i in range(0, len(samples), bs)]

    def ours(dec: ImageDecode) -> Callable[[int], int]:
        def run(rnd: int) -> int:
            n = 0
            for j, batch in enumerate(sample_batches):
                out = dec.decode_batch(batch, seed=rnd * 100_003 + j)
                n += out["image"].shape[0]
            if out["image"].is_cuda:
                torch.cuda.synchronize(out["image"].device)
            return n

        return run

    common = {"train": train, "size": size, "num_threads": threads}
    pipes["ours-cpu-pil"] = ours(ImageDecode(backend="cpu", jpeg_library="pil", device="cpu", **common))
    pipes["ours-cpu-simplejpeg"] = ours(
        ImageDecode(backend="cpu", jpeg_library="simplejpeg", device="cpu", **common)
    )
    pipes["ours-dali-cpu"] = ours(ImageDecode(backend="dali", device="cpu", **common))
    if args.gpu:
        pipes["ours-dali-gpu"] = ours(ImageDecode(backend="dali", device="cuda", **common))
        if args.gpu_fp16:
            pipes["ours-dali-gpu-fp16"] = ours(
                ImageDecode(backend="dali", device="cuda", dtype="float16", **common)
            )
    return pipes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="cores for every pipeline"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", choices=["train", "eval"], default="train")
    ap.add_argument("--gpu", action="store_true", help="also run DALI mixed decode on cuda (needs a GPU)")
    ap.add_argument("--gpu-fp16", action="store_true", help="with --gpu: also float16 output")
    ap.add_argument("--json", help="write results to this JSON file")
    ap.add_argument("--check-params", action="store_true", help="only compare crop boxes with torchvision's")
    args = ap.parse_args(argv)
    if args.check_params:
        check_crop_params()
        return 0

    datas = jpeg_bytes(args.images, seed=2024, sizes=IMAGENET_SIZES, quality=90)
    mean_px = np.mean([len(d) for d in datas])
    pipes = make_pipelines(args, datas)
    for run in pipes.values():  # warm-up: thread pools, DALI build, caches
        run(0)
    best: dict[str, float] = {}  # images per wall second
    cores: dict[str, float] = {}  # CPU seconds per wall second in that best round
    per_cpu: dict[str, float] = {}  # images per CPU second (best round): robust on a shared machine
    for rnd in range(1, args.rounds + 1):
        for name, run in pipes.items():
            c0, t0 = process_tree_cpu_seconds(), time.perf_counter()
            n = run(rnd)
            wall, cpu = time.perf_counter() - t0, process_tree_cpu_seconds() - c0
            if n / wall > best.get(name, 0.0):
                best[name], cores[name] = n / wall, cpu / wall
            per_cpu[name] = max(per_cpu.get(name, 0.0), n / max(cpu, 1e-9))
    cpu_names = [k for k in best if k.startswith("ours-") and "gpu" not in k]
    base_wall = max(best["tv-threads"], best["tv-loader"])
    base_cpu = max(per_cpu["tv-threads"], per_cpu["tv-loader"])
    ratio_wall = max(best[k] for k in cpu_names) / base_wall
    ratio_cpu = max(per_cpu[k] for k in cpu_names) / base_cpu
    print(
        f"decode+augment, preset={args.preset}, {args.images} JPEGs (mean {mean_px / 1024:.0f} KiB), "
        f"out {args.size}x{args.size} float, batch {args.batch_size}, {args.threads} threads/cores, "
        f"best of {args.rounds} rounds"
    )
    print(
        f"{'pipeline':<22}{'images/s':>10}{'cores used':>12}{'vs best tv':>12}{'img/CPU-s':>11}{'vs best tv':>12}"
    )
    for name, rate in best.items():
        print(
            f"{name:<22}{rate:>10.0f}{cores[name]:>12.2f}{rate / base_wall:>11.2f}x"
            f"{per_cpu[name]:>11.0f}{per_cpu[name] / base_cpu:>11.2f}x"
        )
    print(
        f"our best CPU path / best torchvision-style: {ratio_wall:.2f}x images/s, {ratio_cpu:.2f}x images/CPU-s"
    )
    if args.json:
        result = {
            "preset": args.preset,
            "images": args.images,
            "size": args.size,
            "batch_size": args.batch_size,
            "threads": args.threads,
            "rounds": args.rounds,
            "images_per_s": best,
            "cores_used": cores,
            "images_per_cpu_s": per_cpu,
            "best_cpu_path_ratio_wall": ratio_wall,
            "best_cpu_path_ratio_cpu": ratio_cpu,
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
