"""GPU decode + augment: ours on nvImageCodec vs torchvision.io.decode_jpeg(device="cuda"), same work.

Per image, for every runner: JPEG decode, the crop box and flip that ``augment.Preset`` draws
(RandomResizedCrop(size, scale 0.08-1, ratio 3/4-4/3) + flip 0.5; or the eval centre crop), an
antialiased bilinear resize to size x size, the flip, then uint8 out or ImageNet-normalised
float32 out, as an ``[N, 3, size, size]`` batch on the GPU. Runners:

  ours               ImageDecode(backend="nvimgcodec", device=...).decode_batch: the batch decoded
                     with each image's box as its region of interest (hardware JPEG decoder for
                     the --hw-loads share, nvJPEG's CUDA decoder for the rest), resized by torch
  torchvision-cuda   torchvision.io.decode_jpeg(list, device="cuda"): whole images, batched, then
                     the same boxes cropped and resized with the same torch calls
  cpu-backend        ImageDecode(backend="cpu", num_threads=--threads) on the host, then copied to
                     the GPU: what this machine's cores give without GPU decode

Same JPEGs (real photographs, ImageNet-like sizes, 4:2:0 and 4:4:4), same boxes (a function of
(round, key)), one process, rounds interleaved with the order reversed every other round.
Reported per runner: steady img/s (median over rounds), CPU cores busy meanwhile (process CPU
seconds / wall seconds: the cores one GPU needs fed at that rate), CPU ms per image, first
batch, and ratios to torchvision-cuda with the same output dtype.

  python3 benchmarks/bench_gpu.py --json out.json --md out.md       # on a GPU machine
  .venv-bench/bin/python benchmarks/bench_gpu.py --device cpu --images 64 --batch-size 16 --rounds 1
                                                                  # smoke run of the code paths
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stallfree.gpu_decode.augment import IMAGENET_MEAN, IMAGENET_STD, Box, Preset  # noqa: E402
from stallfree.gpu_decode.header import probe  # noqa: E402
from stallfree.gpu_decode.select import ImageDecode  # noqa: E402
from stallfree.testing.images import base_photos, make_image  # noqa: E402

IMAGENET_SIZES = ((500, 375), (375, 500), (500, 333), (640, 480), (400, 300), (800, 600), (333, 500))


def make_jpegs(unique: int, total: int, seed: int = 0) -> list[bytes]:
    """``unique`` real-photo JPEGs (every third 4:4:4, the rest 4:2:0; quality 85-95), repeated to
    ``total``. Repeats decode as much as new files (no decoder caches), and keep the set-up short."""
    rng = np.random.default_rng(seed)
    photos = base_photos()
    specs = [
        (make_image(rng, photos, IMAGENET_SIZES[int(rng.integers(len(IMAGENET_SIZES)))]), i)
        for i in range(unique)
    ]

    def encode(spec: tuple[Any, int]) -> bytes:
        img, i = spec
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=85 + (i * 7) % 11, subsampling=0 if i % 3 == 0 else 2)
        return buf.getvalue()

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        datas = list(pool.map(encode, specs))
    return [datas[i % unique] for i in range(total)]


class Post:
    """The crop/resize/flip/normalise both GPU-decode runners share (ours does the same internally)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.size, self.dtype, self.device = size, dtype, device
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
        self.inv_std = torch.tensor([1 / s for s in IMAGENET_STD], device=device).view(1, 3, 1, 1)

    def __call__(self, chw_images: list[torch.Tensor], boxes: list[Box]) -> torch.Tensor:
        s = self.size
        pixels = torch.empty((len(boxes), 3, s, s), dtype=torch.float32, device=self.device)
        for i, (img, b) in enumerate(zip(chw_images, boxes, strict=True)):
            crop = img[:, b.y : b.y + b.h, b.x : b.x + b.w].unsqueeze(0).float()
            out = F.interpolate(crop, size=(s, s), mode="bilinear", align_corners=False, antialias=True)[0]
            pixels[i] = out.flip(-1) if b.flip else out
        pixels.round_().clamp_(0.0, 255.0)
        if self.dtype == torch.uint8:
            return pixels.to(torch.uint8)
        out = pixels.sub_(self.mean).mul_(self.inv_std)
        return out if self.dtype == torch.float32 else out.to(self.dtype)


def batches(samples: list[dict], batch_size: int) -> list[list[dict]]:
    return [samples[i : i + batch_size] for i in range(0, len(samples), batch_size)]


def runner_ours(
    args: argparse.Namespace, dtype: torch.dtype, load: float
) -> Callable[[list[dict], int], Any]:
    dec = ImageDecode(
        train=args.preset == "train",
        size=args.size,
        backend="nvimgcodec",
        device=args.device,
        dtype=dtype,
        hw_decoder_load=load,
        num_threads=args.threads,
    )
    print(f"  ours: {dec.stats()['reason']}; backends {dec.stats().get('nvimgcodec_backends')}", flush=True)
    return lambda batch, seed: dec.decode_batch(batch, seed=seed)["image"]


def runner_torchvision(args: argparse.Namespace, dtype: torch.dtype) -> Callable[[list[dict], int], Any]:
    from torchvision.io import ImageReadMode, decode_jpeg

    device = torch.device(args.device)
    preset = Preset(train=args.preset == "train", size=args.size)
    post = Post(args.size, dtype, device)

    def run(batch: list[dict], seed: int) -> torch.Tensor:
        boxes = []
        for s in batch:
            info = probe(s["jpg"], None)  # the same header read ours does, for the same boxes
            boxes.append(preset.box(info.width, info.height, seed, s["__key__"]))
        encoded = [torch.frombuffer(bytearray(s["jpg"]), dtype=torch.uint8) for s in batch]
        images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        return post(images, boxes)

    return run


def runner_cpu(args: argparse.Namespace, dtype: torch.dtype) -> Callable[[list[dict], int], Any]:
    dec = ImageDecode(
        train=args.preset == "train", size=args.size, backend="cpu", dtype=dtype, num_threads=args.threads
    )
    device = torch.device(args.device)
    print(f"  cpu-backend: {dec.stats()['reason']}; jpeg_library {dec.stats()['jpeg_library']}", flush=True)
    return lambda batch, seed: dec.decode_batch(batch, seed=seed)["image"].to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2048, help="samples per round (default 2048)")
    ap.add_argument("--unique", type=int, default=512, help="distinct JPEGs among them (default 512)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", choices=["train", "eval"], default="train")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run of the code paths)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="decode threads")
    ap.add_argument(
        "--hw-loads", default="0.65,0", help="ours at these hw_decoder_load values (default 0.65,0)"
    )
    ap.add_argument("--dtypes", default="uint8,float32", help="output dtypes (default uint8,float32)")
    ap.add_argument("--skip", default="", help="comma-separated runner names to leave out")
    ap.add_argument("--json", help="write the figures to this JSON file")
    ap.add_argument("--md", help="write the markdown table to this file")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device visible to torch; use --device cpu for a smoke run", file=sys.stderr)
        return 2
    dtypes = {"uint8": torch.uint8, "float32": torch.float32, "float16": torch.float16}
    wanted = [(name, dtypes[name]) for name in args.dtypes.split(",") if name]
    loads = [float(x) for x in args.hw_loads.split(",") if x]
    skip = {x for x in args.skip.split(",") if x}

    t0 = time.perf_counter()
    datas = make_jpegs(args.unique, args.images)
    samples = [{"__key__": f"img{i:06d}", "jpg": d, "cls": b"0"} for i, d in enumerate(datas)]
    infos = [probe(d, None) for d in datas[: args.unique]]
    print(
        f"bench_gpu: {len(datas)} samples ({args.unique} distinct JPEGs, mean "
        f"{np.mean([i.width for i in infos]):.0f}x{np.mean([i.height for i in infos]):.0f} px, "
        f"{np.mean([len(d) for d in datas[: args.unique]]) / 1024:.0f} KiB) made in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )

    runners: dict[str, tuple[str, Callable[[list[dict], int], Any]]] = {}
    errors: dict[str, str] = {}
    for dname, dtype in wanted:
        candidates: list[tuple[str, Callable[[], Callable[[list[dict], int], Any]]]] = []
        for load in loads:
            candidates.append(
                (f"ours hw_load={load:g} {dname}", lambda d=dtype, lo=load: runner_ours(args, d, lo))
            )
        candidates.append((f"torchvision-cuda {dname}", lambda d=dtype: runner_torchvision(args, d)))
        candidates.append((f"cpu-backend {dname}", lambda d=dtype: runner_cpu(args, d)))
        for name, build in candidates:
            if name.split(" ")[0] in skip:
                continue
            try:
                runners[name] = (dname, build())
            except Exception as exc:  # a runner that cannot start is reported, the rest still run
                errors[name] = f"{type(exc).__name__}: {exc}"
                print(f"  {name}: cannot start: {errors[name]}", flush=True)

    groups = batches(samples, args.batch_size)
    first_batch: dict[str, float] = {}
    for name, (_d, fn) in list(runners.items()):
        try:
            t = time.perf_counter()
            fn(groups[0], 10_000)
            sync(device)
            first_batch[name] = time.perf_counter() - t
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"  {name}: failed on its first batch: {errors[name]}", flush=True)
            del runners[name]

    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    order = list(runners)
    for rnd in range(args.rounds):
        for name in order if rnd % 2 == 0 else order[::-1]:
            fn = runners[name][1]
            sync(device)
            w0, c0 = time.perf_counter(), time.process_time()
            for group in groups:
                fn(group, rnd)
            sync(device)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            rounds[name].append((wall, cpu))
            print(
                f"  round {rnd} {name:32s} {len(samples) / wall:9.0f} img/s  {cpu / wall:5.2f} cores",
                flush=True,
            )

    rows = []
    for name, (dname, _fn) in runners.items():
        walls = [w for w, _ in rounds[name]]
        cpus = [c for _, c in rounds[name]]
        rows.append(
            {
                "runner": name,
                "dtype": dname,
                "img_per_s": statistics.median(len(samples) / w for w in walls),
                "cpu_cores": statistics.median(c / w for w, c in zip(walls, cpus, strict=True)),
                "cpu_ms_per_image": statistics.median(1000 * c / len(samples) for c in cpus),
                "first_batch_s": first_batch[name],
                "rounds": [{"wall_s": w, "cpu_s": c} for w, c in rounds[name]],
            }
        )
    for row in rows:
        base = next((r for r in rows if r["runner"] == f"torchvision-cuda {row['dtype']}"), None)
        row["x_torchvision_img_per_s"] = row["img_per_s"] / base["img_per_s"] if base else None
        row["x_torchvision_cpu_ms"] = base["cpu_ms_per_image"] / row["cpu_ms_per_image"] if base else None

    env = environment(device)
    table = markdown(rows, errors, env, args)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    if args.json:
        result = {"args": vars(args), "environment": env, "rows": rows, "errors": errors}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if rows else 1


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_cores": len(os.sched_getaffinity(0)),
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    for mod in ("torchvision", "nvidia.nvimgcodec"):
        try:
            env[mod] = __import__(mod, fromlist=["__version__"]).__version__
        except ImportError as exc:
            env[mod] = f"missing ({exc})"
    return env


def markdown(rows: list[dict], errors: dict[str, str], env: dict[str, Any], args: argparse.Namespace) -> str:
    head = (
        f"{env.get('gpu', env['device'])}, {env['cpu_cores']} cores, torch {env['torch']}, "
        f"torchvision {env['torchvision']}, nvImageCodec {env['nvidia.nvimgcodec']}; "
        f"{args.images} images/round, batch {args.batch_size}, {args.preset} preset, size {args.size}, "
        f"{args.rounds} rounds (median)"
    )
    lines = [
        head,
        "",
        "| runner | steady img/s | x torchvision | CPU cores busy | CPU ms / image | x torchvision (CPU) | first batch s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        x = f"{r['x_torchvision_img_per_s']:.2f}" if r["x_torchvision_img_per_s"] else "-"
        xc = f"{r['x_torchvision_cpu_ms']:.2f}" if r["x_torchvision_cpu_ms"] else "-"
        lines.append(
            f"| {r['runner']} | {r['img_per_s']:.0f} | {x} | {r['cpu_cores']:.2f} | "
            f"{r['cpu_ms_per_image']:.3f} | {xc} | {r['first_batch_s']:.2f} |"
        )
    for name, err in errors.items():
        lines.append(f"| {name} | failed: {err[:120]} | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
