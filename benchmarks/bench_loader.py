"""torch.utils.data.DataLoader vs stallfree.DataLoader, side by side in one run (issue 3).

Same dataset (real-photo JPEGs from stallfree.testing.images in tar shards written by ShardWriter),
same per-sample work (PIL decode, resize shorter side to 256, random 224 crop, random flip, to a
float tensor in [0, 1]; written here, no torchvision), same batch size, same number of workers.
torch reads ``dataset[i]`` per sample in its workers; stallfree gets ``decode=`` and reads batches
ahead with ``get_many``. Rounds alternate torch / stallfree to spread machine noise.

A third row runs ours with ``decode_threads=1`` (by default each of our workers decodes on as
many threads as there are cores per worker, since PIL releases the GIL; torch's worker uses one).

Reports images/s (ratio ours/torch), time to first batch, peak RSS and peak PSS of the process
tree (psutil, main + workers; RSS counts a shared page once per process mapping it, PSS splits it),
private memory of the tree plus the growth of system shared memory (USS+shm: every byte once,
including batches in flight that no process has mapped; other jobs' shared memory adds noise),
and CPU time per image (process + reaped workers: robust to other load on the machine). The
consumer reads each batch (``sum()``), as a training step would. Best of the rounds per figure. ``--remote-latency S`` serves the shards over the loopback HTTP server with S
seconds added per request (an object store), where batched ranged reads matter.

``--retain-ab`` adds a row of ours with the workers' allocator left at glibc's defaults (the loader
calls ``stallfree.shards.memory.retain_freed_memory()`` in each worker; this row does not), to
measure that setting in the same run. ``--raw`` drops the decode on both sides (the loader only
reads and collates the samples' bytes; torch with ``collate_fn=list``): the read path alone.

    .venv/bin/python benchmarks/bench_loader.py [--images 256] [--workers 2] [--epochs 2] [--rounds 2]
        [--remote-latency 0.005] [--fetch-threads N] [--retain-ab] [--raw] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.utils.data as tud
from PIL import Image

from stallfree.loader.dataloader import DataLoader as StallfreeLoader
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.httpserve import serve_directory
from stallfree.testing.images import jpeg_bytes

CROP = 224


def decode_augment(sample: dict) -> dict:
    """PIL decode -> shorter side 256 -> random 224 crop -> random flip -> float CHW tensor."""
    img = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
    w, h = img.size
    s = 256 / min(w, h)
    img = img.resize((max(CROP, round(w * s)), max(CROP, round(h * s))), Image.Resampling.BILINEAR)
    x, y = random.randint(0, img.width - CROP), random.randint(0, img.height - CROP)
    img = img.crop((x, y, x + CROP, y + CROP))
    if random.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    t = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).float().div_(255)
    return {"image": t, "label": int(sample["cls"])}


class TorchStyle(tud.Dataset):
    """What a torch user writes: the decode in ``__getitem__``, one sample read at a time."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return decode_augment(self.ds[i])


def _shmem() -> int:
    """System-wide shared memory in use (/proc/meminfo Shmem): batches in flight between processes
    live there, mapped or not, so no per-process figure sees all of them."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Samples the RSS (and PSS: shared pages split among the processes mapping them) of this
    process and its children every 10 ms; keeps the peaks."""

    def __init__(self) -> None:
        self.peak = 0
        self.peak_pss = 0
        self.peak_uss_shm = 0
        self._shm0 = _shmem()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = pss = uss = 0
            with contextlib.suppress(psutil.Error):
                info = me.memory_full_info()
                total, pss, uss = info.rss, info.pss, info.uss
                for c in me.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        info = c.memory_full_info()
                        total += info.rss
                        pss += info.pss
                        uss += info.uss
            self.peak = max(self.peak, total)
            self.peak_pss = max(self.peak_pss, pss)
            self.peak_uss_shm = max(self.peak_uss_shm, uss + max(0, _shmem() - self._shm0))
            time.sleep(0.01)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _cpu_s() -> float:
    """CPU seconds of this process plus its exited (reaped) children: workers included."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_one(make, epochs: int) -> dict:
    gc.collect()
    cpu0 = _cpu_s()
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        loader = make()
        first = None
        images = 0
        for _ in range(epochs):
            for batch in loader:
                if first is None:
                    first = time.perf_counter() - t0
                if isinstance(batch, dict) and "image" in batch:
                    images += batch["image"].shape[0]
                    batch["image"].sum()  # the step reads the batch, as training does
                else:  # --raw: the step touches every sample's bytes
                    samples = batch if isinstance(batch, list) else _rows(batch)
                    images += len(samples)
                    sum(len(s["jpg"]) for s in samples)
        elapsed = time.perf_counter() - t0
        del loader
        gc.collect()
    return {
        "images": images,
        "seconds": elapsed,
        "images_per_s": images / elapsed,
        "first_batch_s": first,
        "peak_rss_mb": rss.peak / 2**20,
        "peak_pss_mb": rss.peak_pss / 2**20,
        "peak_uss_shm_mb": rss.peak_uss_shm / 2**20,
        "cpu_ms_per_image": (_cpu_s() - cpu0) * 1000 / images,
    }


def _rows(batch: dict) -> list[dict]:
    return [dict(zip(batch, vals, strict=True)) for vals in zip(*batch.values(), strict=True)]


class _DefaultAllocator(StallfreeLoader):
    """Ours with the workers' glibc allocator left at its defaults (the --retain-ab baseline)."""

    def _spec(self, base_seed: int):
        return dataclasses.replace(super()._spec(base_seed), retain_memory=False)


def build_dataset(root: Path, n: int) -> str:
    jpgs = jpeg_bytes(n, seed=0)
    with ShardWriter(str(root / "shards"), format="tar", max_samples=64) as w:
        for i, jpg in enumerate(jpgs):
            w.write({"__key__": f"img{i:06d}", "jpg": jpg, "cls": str(i % 10).encode()})
    return str(root / "shards")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--remote-latency", type=float, default=None, help="serve shards over loopback HTTP")
    ap.add_argument(
        "--fetch-threads", type=int, default=None, help="stallfree: tasks each worker reads at once"
    )
    ap.add_argument("--retain-ab", action="store_true", help="add ours without retain_freed_memory")
    ap.add_argument("--raw", action="store_true", help="no decode: read and collate bytes only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = build_dataset(Path(tmp), args.images)
        server = (
            serve_directory(path, latency_s=args.remote_latency)
            if args.remote_latency is not None
            else contextlib.nullcontext()
        )
        with server as srv:
            url = srv.url if srv is not None else path
            ds = open_dataset(url)
            bs, nw = args.batch_size, args.workers

            def torch_loader():
                if args.raw:
                    return tud.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=nw, collate_fn=list)
                return tud.DataLoader(TorchStyle(ds), batch_size=bs, shuffle=True, num_workers=nw)

            def our_loader(threads=None, cls=StallfreeLoader):
                return lambda: cls(
                    ds,
                    batch_size=bs,
                    shuffle=True,
                    num_workers=nw,
                    decode=None if args.raw else decode_augment,
                    seed=0,
                    decode_threads=threads,
                    fetch_threads=args.fetch_threads,
                )

            rows: dict[str, list[dict]] = {"torch": [], "stallfree": [], "stallfree_1thread": []}
            if args.retain_ab:
                rows["stallfree_glibc_default"] = []
            for _ in range(args.rounds):
                rows["torch"].append(run_one(torch_loader, args.epochs))
                rows["stallfree"].append(run_one(our_loader(), args.epochs))
                rows["stallfree_1thread"].append(run_one(our_loader(1), args.epochs))
                if args.retain_ab:
                    rows["stallfree_glibc_default"].append(
                        run_one(our_loader(cls=_DefaultAllocator), args.epochs)
                    )

    def best(name: str, key: str, fn=max) -> float:
        return fn(r[key] for r in rows[name])

    names = list(rows)
    summary: dict = {"settings": vars(args), "cores": len(os.sched_getaffinity(0)), "rounds": rows}
    for name in names:
        summary[name] = {
            "images_per_s": best(name, "images_per_s"),
            "first_batch_s": best(name, "first_batch_s", min),
            "peak_rss_mb": best(name, "peak_rss_mb", min),
            "peak_pss_mb": best(name, "peak_pss_mb", min),
            "peak_uss_shm_mb": best(name, "peak_uss_shm_mb", min),
            "cpu_ms_per_image": best(name, "cpu_ms_per_image", min),
        }
    summary["ratio_images_per_s"] = summary["stallfree"]["images_per_s"] / summary["torch"]["images_per_s"]
    summary["ratio_1thread_images_per_s"] = (
        summary["stallfree_1thread"]["images_per_s"] / summary["torch"]["images_per_s"]
    )
    if args.retain_ab:
        summary["ratio_retain_images_per_s"] = (
            summary["stallfree"]["images_per_s"] / summary["stallfree_glibc_default"]["images_per_s"]
        )
        summary["round_ratios_retain"] = [
            s["images_per_s"] / d["images_per_s"]
            for s, d in zip(rows["stallfree"], rows["stallfree_glibc_default"], strict=True)
        ]
    summary["round_ratios"] = [
        s["images_per_s"] / t["images_per_s"] for t, s in zip(rows["torch"], rows["stallfree"], strict=True)
    ]
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    where = (
        f"HTTP, {args.remote_latency * 1000:.0f} ms/request" if args.remote_latency is not None else "local"
    )
    if args.raw:
        where += ", raw: no decode"
    sys.stdout.write(
        f"{args.images} JPEGs ({where}), batch {bs}, {nw} workers, {args.epochs} epochs, best of {args.rounds}, "
        f"{summary['cores']} cores\n"
    )
    sys.stdout.write(
        f"{'loader':<18} {'images/s':>9} {'first batch s':>14} {'peak RSS MiB':>13} {'peak PSS MiB':>13} "
        f"{'USS+shm MiB':>12} {'CPU ms/image':>13}\n"
    )
    for name in names:
        r = summary[name]
        sys.stdout.write(
            f"{name:<18} {r['images_per_s']:>9.1f} {r['first_batch_s']:>14.3f} {r['peak_rss_mb']:>13.0f} "
            f"{r['peak_pss_mb']:>13.0f} {r['peak_uss_shm_mb']:>12.0f} "
            f"{r['cpu_ms_per_image']:>13.2f}\n"
        )
    ratios = ", ".join(f"{x:.2f}" for x in summary["round_ratios"])
    sys.stdout.write(
        f"ratio stallfree/torch images/s (best of rounds): {summary['ratio_images_per_s']:.2f}x; "
        f"median of per-round ratios {statistics.median(summary['round_ratios']):.2f}x ({ratios})\n"
    )
    sys.stdout.write(
        f"ratio stallfree (decode_threads=1)/torch: {summary['ratio_1thread_images_per_s']:.2f}x\n"
    )
    if args.retain_ab:
        ratios = ", ".join(f"{x:.2f}" for x in summary["round_ratios_retain"])
        sys.stdout.write(
            f"ratio stallfree/stallfree_glibc_default images/s: {summary['ratio_retain_images_per_s']:.2f}x "
            f"(rounds {ratios})\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
