"""torch.utils.data.DataLoader vs stallfree.DataLoader, side by side in one run (issue 3).

Same dataset (real-photo JPEGs from stallfree.testing.images in tar shards written by ShardWriter),
same per-sample work (PIL decode, resize shorter side to 256, random 224 crop, random flip, to a
float tensor in [0, 1]; written here, no torchvision), same batch size, same number of workers.
torch reads ``dataset[i]`` per sample in its workers; stallfree gets ``decode=`` and reads batches
ahead with ``get_many``. Rounds alternate torch / stallfree to spread machine noise.

A third row runs ours with ``decode_threads=1`` (by default each of our workers decodes on as
many threads as there are cores per worker, since PIL releases the GIL; torch's worker uses one).

Reports images/s (ratio ours/torch), time to first batch, peak RSS and peak PSS of the process
tree (psutil, main + workers, RSS every 10 ms, PSS every 0.5 s: see PeakRSS; RSS counts a shared
page once per process mapping it, PSS splits it),
private memory of the tree plus the growth of system shared memory (USS+shm: every byte once,
including batches in flight that no process has mapped; other jobs' shared memory adds noise),
and CPU time per image (process + reaped workers: robust to other load on the machine). The
consumer reads each batch (``sum()``, on one torch thread: it stands for GPU work), as a training step would. Each trial runs in a child forked
from the clean benchmark process (same starting memory for every trial). Best of the rounds per figure. ``--remote-latency S`` serves the shards over the loopback HTTP server with S
seconds added per request (an object store), where batched ranged reads matter.

``--recipe imagenet`` compares the standard ImageNet training recipe instead (RandomResizedCrop(224),
flip, ToTensor, Normalize): torch's DataLoader with torchvision's transforms in ``__getitem__`` (the
script every PyTorch user starts from) vs ``stallfree.DataLoader(..., decode=ImageDecode())`` (the same
recipe, same output shape/dtype/normalisation, run by our batch decoder; CPU here). It needs torchvision,
so it runs in the benchmark environment: ``bash benchmarks/env.sh`` then ``.venv-bench/bin/python``.

``--mapped-ab`` adds a row of ours whose processes keep every shared slot they touched mapped (the
loader normally lets go of a slot's pages once done with its batch: ``shm.release_pages``), to
measure that trade (page faults vs resident memory) in the same run. ``--dropin`` adds ours given torch's own Dataset unchanged (the decode in
``__getitem__``, no ``decode=``): the one-import swap. ``--raw`` drops the decode on
both sides (the loader only reads and collates the samples' bytes; torch with ``collate_fn=list``).

    .venv/bin/python benchmarks/bench_loader.py [--images 256] [--workers 2] [--epochs 2] [--rounds 2]
        [--remote-latency 0.005] [--fetch-threads N] [--mapped-ab] [--dropin] [--raw] [--json]
    .venv-bench/bin/python benchmarks/bench_loader.py --recipe imagenet [...]
"""

from __future__ import annotations

import argparse
import contextlib
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
from stallfree.loader.shm import storage as shm
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
    """Peak RSS of this process and its children, sampled every 10 ms; peak PSS and USS+shm,
    sampled every ``slow_every`` s.

    RSS is cheap to read (/proc/PID/statm). PSS and USS are not: the kernel walks every page
    table (psutil's memory_full_info: ~12 ms per process here), so sampling them every 10 ms
    kept most of a core busy and throttled whatever loader ran; they are sampled sparsely.
    """

    def __init__(self, slow_every: float = 0.5) -> None:
        self.peak = 0
        self.peak_pss = 0
        self.peak_uss_shm = 0
        self.slow_every = slow_every
        self._shm0 = _shmem()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        next_slow = 0.0
        while not self._stop.is_set():
            slow = time.monotonic() >= next_slow
            total = pss = uss = 0
            with contextlib.suppress(psutil.Error):
                for proc in [me, *me.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        if slow:
                            info = proc.memory_full_info()
                            pss += info.pss
                            uss += info.uss
                        else:
                            info = proc.memory_info()
                        total += info.rss
            self.peak = max(self.peak, total)
            if slow:
                self.peak_pss = max(self.peak_pss, pss)
                self.peak_uss_shm = max(self.peak_uss_shm, uss + max(0, _shmem() - self._shm0))
                next_slow = time.monotonic() + self.slow_every
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
    # The consumer's step (a sum over the batch) stands for GPU work: one CPU thread, so torch's
    # intra-op pool does not spin on the cores the loaders' workers need (same for both loaders).
    torch.set_num_threads(1)
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


def run_isolated(make, epochs: int) -> dict:
    """``run_one`` in a child forked from this (clean) process, so that every trial starts from the
    same memory: run in turn in one process, a later loader's workers would inherit whatever the
    earlier trials left in the parent's heap, and its RSS would carry it."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send(run_one(make, epochs))
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            send.send({"error": f"{type(exc).__name__}: {exc}"})

    proc = ctx.Process(target=child)
    proc.start()
    result = recv.recv()
    proc.join()
    if "error" in result:
        raise RuntimeError(f"trial failed: {result['error']}")
    return result


def _rows(batch: dict) -> list[dict]:
    return [dict(zip(batch, vals, strict=True)) for vals in zip(*batch.values(), strict=True)]


class TorchvisionRecipe(tud.Dataset):
    """The standard ImageNet training recipe as torch users write it: torchvision in ``__getitem__``."""

    def __init__(self, ds) -> None:
        import torchvision.transforms as T

        from stallfree.gpu_decode.augment import IMAGENET_MEAN, IMAGENET_STD

        self.ds = ds
        norm = T.Normalize([m / 255 for m in IMAGENET_MEAN], [s / 255 for s in IMAGENET_STD])
        self.transform = T.Compose([T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.ToTensor(), norm])

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        sample = self.ds[i]
        img = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
        return {"image": self.transform(img), "label": int(sample["cls"])}


@contextlib.contextmanager
def slots_kept_mapped(on: bool):
    """For the --mapped-ab row: processes keep their slot mappings (workers fork with this too)."""
    if not on:
        yield
        return
    real = shm.release_pages, shm.release_range
    shm.release_pages, shm.release_range = (lambda storage: False), (lambda addr, nbytes: False)
    try:
        yield
    finally:
        shm.release_pages, shm.release_range = real


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
    ap.add_argument("--mapped-ab", action="store_true", help="add ours with slots kept mapped")
    ap.add_argument(
        "--dropin", action="store_true", help="add ours given torch's Dataset as is (decode in __getitem__)"
    )
    ap.add_argument("--recipe", choices=["fn", "imagenet"], default="fn", help="see the module docstring")
    ap.add_argument("--raw", action="store_true", help="no decode: read and collate bytes only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    if args.recipe == "imagenet":  # imported once here, not inside each trial's timing
        import torchvision.transforms  # noqa: F401

        import stallfree.gpu_decode.select  # noqa: F401
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
                data = TorchvisionRecipe(ds) if args.recipe == "imagenet" else TorchStyle(ds)
                return tud.DataLoader(data, batch_size=bs, shuffle=True, num_workers=nw)

            def our_decode(threads):
                if args.raw:
                    return None
                if args.recipe == "imagenet":
                    from stallfree.gpu_decode.select import ImageDecode

                    return ImageDecode(train=True, size=CROP, backend="cpu", num_threads=threads)
                return decode_augment

            def our_loader(threads=None):
                return lambda: StallfreeLoader(
                    ds,
                    batch_size=bs,
                    shuffle=True,
                    num_workers=nw,
                    decode=our_decode(threads),
                    seed=0,
                    decode_threads=threads if args.recipe == "fn" else None,
                    fetch_threads=args.fetch_threads,
                )

            rows: dict[str, list[dict]] = {"torch": [], "stallfree": [], "stallfree_1thread": []}
            if args.mapped_ab:
                rows["stallfree_kept_mapped"] = []
            if args.dropin:
                rows["stallfree_dropin"] = []
            for _ in range(args.rounds):
                rows["torch"].append(run_isolated(torch_loader, args.epochs))
                rows["stallfree"].append(run_isolated(our_loader(), args.epochs))
                rows["stallfree_1thread"].append(run_isolated(our_loader(1), args.epochs))
                if args.dropin:  # only the import changed: torch's Dataset, no decode=
                    data = TorchvisionRecipe(ds) if args.recipe == "imagenet" else TorchStyle(ds)
                    rows["stallfree_dropin"].append(
                        run_isolated(
                            lambda data=data: StallfreeLoader(
                                data, batch_size=bs, shuffle=True, num_workers=nw, seed=0
                            ),
                            args.epochs,
                        )
                    )
                if args.mapped_ab:
                    with slots_kept_mapped(True):
                        rows["stallfree_kept_mapped"].append(run_isolated(our_loader(), args.epochs))

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
    if args.mapped_ab:
        summary["round_ratios_mapped"] = [
            s["images_per_s"] / d["images_per_s"]
            for s, d in zip(rows["stallfree"], rows["stallfree_kept_mapped"], strict=True)
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
    elif args.recipe == "imagenet":
        where += ", ImageNet train recipe: torchvision vs ImageDecode"
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
    if args.mapped_ab:
        ratios = ", ".join(f"{x:.2f}" for x in summary["round_ratios_mapped"])
        sys.stdout.write(f"ratio stallfree/stallfree_kept_mapped images/s per round: {ratios}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
