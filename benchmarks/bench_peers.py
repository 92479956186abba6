"""Image training input, side by side with the fastest things a user could pick instead.

Same files, same per-sample work, same output, same worker count, one process run:
  per sample: JPEG decode + RandomResizedCrop(224, scale 0.08-1, ratio 3/4-4/3, antialiased
  bilinear) + random horizontal flip; per batch: uint8 (B, 3, 224, 224) images + int64 labels.

Runners (peers first; the best peer on each measure is the yardstick):
  torch-pil        torch DataLoader + torchvision ImageFolder + PIL + transforms.v2 (ToImage,
                   RandomResizedCrop, RandomHorizontalFlip), persistent workers
  torch-simplejpeg torch DataLoader + ImageFolder of bytes + simplejpeg decode + v2 crop/flip on the
                   uint8 tensor, persistent workers
  dali             DALI's native CPU pipeline (device_id=None, num_threads = --workers) over our tar
                   shards with our .idx: readers.webdataset + decoders.image_random_crop +
                   resize(antialias) + flip(random coin) + transpose to CHW, DALI's defaults
  dali-tuned       the same work with the settings a DALI expert reaches for (DALI_TUNED, override
                   with --dali-tuned JSON): mirror and CHW transpose fused into
                   crop_mirror_normalize(dtype=UINT8) without mean/std, deeper queues, dynamic executor
  spdl             SPDL 0.8 (Meta's thread pipeline): spdl.pipeline.PipelineBuilder, --workers
                   threads decoding with spdl.io (FFmpeg: demux, then one filter graph crops the
                   RandomResizedCrop box, scales to 224 bilinear, flips on a coin, converts to
                   RGB), batches converted with spdl.io.convert_frames (needs Debian's FFmpeg libs)
  tdn-process      torchdata.nodes 0.11: SamplerWrapper -> ParallelMapper(method="process",
                   --workers) running the torch-simplejpeg per-sample work -> Batcher -> collate
  tdn-thread       the same with ParallelMapper(method="thread")
  ours-cpu         stallfree.DataLoader(open_dataset(shards), decode=ImageDecode(train=True,
                   size=224, dtype="uint8", backend="cpu"))
  ours-auto        the same, backend="auto"
  ours-float32     the same, backend="auto", dtype="float32" (normalised): different output, shown
                   but never counted in the uint8 ratios

Per round, each runner is built from nothing, its first batch timed (start-up included: worker
processes, DALI's build, the first decodes), then --warmup batches dropped, then --batches steady
batches timed. Rounds alternate the runner order (reversed every other round), so drift in the
machine's load hits all alike; each figure is the median over rounds. Measures:
  img/s      steady images per second of wall time
  CPU ms/img CPU time of the whole process tree (this process, its threads, live worker processes
             and reaped ones) over the steady batches, per image
  first s    seconds from building the loader to its first batch
  peak PSS   the largest proportional set size of the process tree (this process + workers),
             sampled every 0.2 s while the runner ran (the baseline of this process, with torch,
             torchvision and DALI imported, is part of every row; it is printed separately)
Ratios are "x best peer", > 1 = better than the best of the peers on that measure (img/s: ours /
best; costs: best / ours).

Needs the benchmark environment (torchvision, DALI, simplejpeg, SPDL, torchdata):
  bash benchmarks/env.sh
  .venv-bench/bin/python benchmarks/bench_peers.py --images 4000 --rounds 3 --batches 60 --json out.json
The data set is written once into --dir (default benchmarks/out/peers-data-<images>) and reused.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_data  # noqa: E402  (the sibling module, also when run from elsewhere)

from stallfree.harness.metrics import process_tree_cpu_seconds  # noqa: E402

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
# dali-tuned: what a DALI user tuning a CPU pipeline reaches for first. The mirror and the HWC->CHW
# transpose fused into one crop_mirror_normalize(dtype=UINT8) (no mean/std: plain uint8 out, one
# copy less), a deeper pipeline queue and reader prefetch (smooth out slow batches), the dynamic
# executor. fast_idct (libjpeg-turbo's less exact IFAST IDCT) is off: it changes the decode's
# arithmetic, so it is not the same work; pass --dali-tuned '{"fast_idct": true}' to see it.
# On the shared 2-core machine, short sweeps of these could not be told apart from load noise
# (CPU ms / image within 2.0-2.6 for all 24 combinations), so override them with --dali-tuned.
DALI_TUNED: dict[str, Any] = {"fused_cmn": True, "queue_depth": 3, "reader_prefetch": 2, "exec_dynamic": True}

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Runner:
    name: str
    label: str
    peer: bool  # one of the alternatives (the yardstick)
    counted: bool  # uint8 output, counted in the same-work ratios
    make: Callable[[argparse.Namespace, peers_data.PeersData], Iterator[Batch]]
    needs: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------- torch


def _torch_loader(args: argparse.Namespace, dataset: Any) -> Iterator[Batch]:
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    try:
        while True:
            yield from loader
    finally:
        del loader  # persistent workers stop with the loader's iterator
        gc.collect()


def torch_pil(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    from torchvision import datasets
    from torchvision.transforms import v2

    transform = v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(SIZE, scale=SCALE, ratio=RATIO, antialias=True),
            v2.RandomHorizontalFlip(),
        ]
    )
    yield from _torch_loader(args, datasets.ImageFolder(str(data.folder), transform=transform))


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class SimplejpegCrop:
    """simplejpeg decode to HWC uint8, then v2 crop/flip on the CHW view (channels-last strides,
    which torch's uint8 antialiased resize takes fastest), made contiguous like the others."""

    def __init__(self) -> None:
        from torchvision.transforms import v2

        self.ops = v2.Compose(
            [v2.RandomResizedCrop(SIZE, scale=SCALE, ratio=RATIO, antialias=True), v2.RandomHorizontalFlip()]
        )

    def __call__(self, data: bytes) -> torch.Tensor:
        import simplejpeg

        hwc = simplejpeg.decode_jpeg(data, colorspace="RGB")
        return self.ops(torch.from_numpy(hwc).permute(2, 0, 1)).contiguous()


def torch_simplejpeg(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    from torchvision import datasets

    dataset = datasets.ImageFolder(str(data.folder), loader=_read_bytes, transform=SimplejpegCrop())
    yield from _torch_loader(args, dataset)


# ----------------------------------------------------------------------------------------- DALI


def _ascii_labels(raw: torch.Tensor) -> torch.Tensor:
    """DALI hands each ``cls`` as its ASCII digits (zero-padded to the batch's longest); to int64."""
    raw = raw.reshape(raw.shape[0], -1).to(torch.int64)
    out = torch.zeros(raw.shape[0], dtype=torch.int64)
    for j in range(raw.shape[1]):
        col = raw[:, j]
        digit = col > 0
        out = torch.where(digit, out * 10 + (col - 48), out)
    return out


def _dali(
    args: argparse.Namespace,
    data: peers_data.PeersData,
    *,
    fused_cmn: bool,
    queue_depth: int,
    reader_prefetch: int = 1,
    fast_idct: bool = False,
    exec_dynamic: bool | None = None,
) -> Iterator[Batch]:
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(
        batch_size=args.batch,
        num_threads=max(1, args.workers),
        device_id=None,
        seed=args.seed + 1,
        prefetch_queue_depth=queue_depth,
        exec_dynamic=exec_dynamic,
    )
    def pipe() -> Any:
        jpegs, labels = fn.readers.webdataset(
            paths=data.tars,
            index_paths=data.idxs,
            ext=["jpg", "cls"],
            missing_component_behavior="error",
            random_shuffle=True,
            prefetch_queue_depth=reader_prefetch,
            name="Reader",
        )
        images = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.RGB,
            random_area=list(SCALE),
            random_aspect_ratio=list(RATIO),
            num_attempts=10,
            use_fast_idct=fast_idct,
        )
        images = fn.resize(
            images, resize_x=SIZE, resize_y=SIZE, interp_type=types.INTERP_LINEAR, antialias=True
        )
        coin = fn.random.coin_flip(probability=0.5)
        if fused_cmn:
            images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=coin)
        else:
            images = fn.transpose(fn.flip(images, horizontal=coin), perm=[2, 0, 1])
        return images, fn.pad(labels, fill_value=0)

    p = pipe()
    p.build()
    it = DALIGenericIterator(
        [p], ["image", "label"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP, auto_reset=True
    )
    try:
        while True:
            for out in it:
                yield out[0]["image"], _ascii_labels(out[0]["label"])
    finally:
        del it, p  # DALI frees its threads and buffers with the pipeline
        gc.collect()


def dali_default(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    yield from _dali(args, data, fused_cmn=False, queue_depth=2)


def dali_tuned(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    yield from _dali(args, data, **args.dali_tuned)


# ----------------------------------------------------------------------------------------- SPDL


def rrc_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (x, y, w, h): an area share in SCALE and an aspect ratio drawn
    log-uniformly in RATIO, 10 tries, else the centre crop clamped to RATIO (the same rule
    torchvision and DALI follow), for the runners that crop outside torchvision."""
    area = width * height
    lo, hi = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        ratio = math.exp(rng.uniform(lo, hi))
        w = int(round(math.sqrt(target * ratio)))
        h = int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height
    if in_ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif in_ratio > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class SpdlDecode:
    """One sample in SPDL: demux the JPEG, then one FFmpeg filter graph crops the random box,
    scales it to SIZE (bilinear; swscale filters over the whole footprint when shrinking),
    flips it on a coin and converts to RGB, in the decode call (SPDL releases the GIL there).
    Seeded per sample from (seed, epoch, position), so the threads draw independently."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, item: tuple[int, int, str, int]) -> tuple[Any, int]:
        import spdl.io

        epoch, pos, path, label = item
        rng = random.Random(hash((self.seed, epoch, pos)))
        with open(path, "rb") as f:
            data = f.read()
        packets = spdl.io.demux_image(data)
        x, y, w, h = rrc_box(packets.width, packets.height, rng)
        flip = ",hflip" if rng.random() < 0.5 else ""
        desc = f"crop={w}:{h}:{x}:{y},scale={SIZE}:{SIZE}:flags=bilinear{flip},format=rgb24"
        return spdl.io.decode_packets(packets, filter_desc=desc), label


def _spdl_collate(items: list[tuple[Any, int]]) -> Batch:
    """SPDL's batching: the frames converted into one (B, H, W, 3) buffer, then CHW like the others."""
    import spdl.io

    frames = [f for f, _ in items]
    images = spdl.io.to_torch(spdl.io.convert_frames(frames)).permute(0, 3, 1, 2).contiguous()
    return images, torch.tensor([label for _, label in items], dtype=torch.int64)


def spdl_runner(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    from spdl.pipeline import PipelineBuilder
    from torchvision import datasets

    samples = datasets.ImageFolder(str(data.folder)).samples
    order = random.Random(args.seed)

    def source() -> Iterator[tuple[int, int, str, int]]:
        epoch = 0
        while True:  # endless: a new shuffle per epoch, as the other runners' loaders do
            positions = list(range(len(samples)))
            order.shuffle(positions)
            for pos in positions:
                yield (epoch, pos, *samples[pos])
            epoch += 1

    pipeline = (
        PipelineBuilder()
        .add_source(source())
        .pipe(SpdlDecode(args.seed), concurrency=max(1, args.workers))
        .aggregate(args.batch, drop_last=True)
        .pipe(_spdl_collate)
        .add_sink(3)
        .build(num_threads=max(1, args.workers))
    )
    with pipeline.auto_stop():
        yield from pipeline.get_iterator(timeout=120)


# ------------------------------------------------------------------------------- torchdata.nodes


def _torchdata_nodes(args: argparse.Namespace, data: peers_data.PeersData, method: str) -> Iterator[Batch]:
    """torchdata.nodes 0.11: a sampler node, ParallelMapper over --workers processes or threads
    running the torch-simplejpeg per-sample work, a Batcher and torch's collate."""
    from torch.utils.data import RandomSampler, default_collate
    from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, SamplerWrapper
    from torchvision import datasets

    dataset = datasets.ImageFolder(str(data.folder), loader=_read_bytes, transform=SimplejpegCrop())
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed))
    node = SamplerWrapper(sampler)
    node = ParallelMapper(
        node,
        map_fn=dataset.__getitem__,
        num_workers=max(1, args.workers),
        method=method,
        in_order=True,
        multiprocessing_context="forkserver" if method == "process" else None,
    )
    node = Mapper(Batcher(node, batch_size=args.batch, drop_last=True), default_collate)
    loader = Loader(node)
    try:
        while True:
            yield from loader
    finally:
        del loader, node
        gc.collect()


def torchdata_process(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    yield from _torchdata_nodes(args, data, "process")


def torchdata_thread(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    yield from _torchdata_nodes(args, data, "thread")


# ------------------------------------------------------------------------------------------ ours

NOTES: list[str] = []


def _ours(args: argparse.Namespace, data: peers_data.PeersData, backend: str, dtype: str) -> Iterator[Batch]:
    from stallfree import DataLoader, ImageDecode, open_dataset

    decode = ImageDecode(train=True, size=SIZE, backend=backend, dtype=dtype)
    loader = DataLoader(
        open_dataset(str(data.shards)),
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        drop_last=True,
        seed=args.seed,
        decode=decode,
    )
    try:
        while True:
            for batch in loader:
                yield batch["image"], batch["label"]
    finally:
        del loader
        gc.collect()


def ours_cpu(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    yield from _ours(args, data, "cpu", "uint8")


def ours_auto(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    yield from _ours(args, data, "auto", "uint8")


def ours_float32(args: argparse.Namespace, data: peers_data.PeersData) -> Iterator[Batch]:
    yield from _ours(args, data, "auto", "float32")


RUNNERS = (
    Runner(
        "torch-pil",
        "torch DataLoader + ImageFolder + PIL + transforms.v2 (uint8)",
        True,
        True,
        torch_pil,
        ("torchvision",),
    ),
    Runner(
        "torch-simplejpeg",
        "torch DataLoader + simplejpeg + v2 crop/flip (uint8)",
        True,
        True,
        torch_simplejpeg,
        ("torchvision", "simplejpeg"),
    ),
    Runner("dali", "DALI CPU pipeline, defaults (uint8)", True, True, dali_default, ("nvidia.dali",)),
    Runner(
        "spdl",
        "SPDL 0.8 pipeline, spdl.io FFmpeg decode + crop/scale/flip filter, threads (uint8)",
        True,
        True,
        spdl_runner,
        ("spdl.pipeline", "spdl.io", "torchvision"),
    ),
    Runner(
        "tdn-process",
        "torchdata.nodes 0.11 ParallelMapper, processes, simplejpeg + v2 (uint8)",
        True,
        True,
        torchdata_process,
        ("torchdata.nodes", "torchvision", "simplejpeg"),
    ),
    Runner(
        "tdn-thread",
        "torchdata.nodes 0.11 ParallelMapper, threads, simplejpeg + v2 (uint8)",
        True,
        True,
        torchdata_thread,
        ("torchdata.nodes", "torchvision", "simplejpeg"),
    ),
    Runner("dali-tuned", "DALI CPU pipeline, tuned (uint8)", True, True, dali_tuned, ("nvidia.dali",)),
    Runner("ours-cpu", 'stallfree ImageDecode backend="cpu" (uint8)', False, True, ours_cpu),
    Runner("ours-auto", 'stallfree ImageDecode backend="auto" (uint8)', False, True, ours_auto),
    Runner(
        "ours-float32",
        'stallfree ImageDecode backend="auto" (float32 normalised; not counted)',
        False,
        False,
        ours_float32,
    ),
)


# ------------------------------------------------------------------------------------- measuring


def tree_cpu_seconds() -> float:
    """CPU seconds of this process, its live descendants and its reaped children: a worker that
    exits mid-measurement (a non-persistent pool at an epoch's end) still counts."""
    t = os.times()
    return process_tree_cpu_seconds() + t.children_user + t.children_system


def tree_pss() -> int:
    """Proportional set size of this process and its descendants, bytes."""
    import psutil

    proc = psutil.Process()
    total = proc.memory_full_info().pss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_full_info().pss
        except psutil.Error:
            continue
    return total


class PeakPss:
    """Samples ``tree_pss`` on a thread until stopped; ``peak`` is the largest sample.

    Reading smaps is not free (tens of ms for a process with torch and DALI loaded), so it samples
    once a second and keeps its own CPU time (``cpu_s``), which ``measure`` takes out of the
    runner's figure: otherwise it is charged to every runner alike and shrinks every ratio."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.cpu_s = 0.0
        self._lock = threading.Lock()
        self.peak = tree_pss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            c0 = time.thread_time()
            try:
                self.peak = max(self.peak, tree_pss())
            except Exception:  # a process vanishing between listing and reading
                pass
            with self._lock:
                self.cpu_s += time.thread_time() - c0

    def cpu_seconds(self) -> float:
        with self._lock:
            return self.cpu_s

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_pss())
        return self.peak


def check_batch(runner: Runner, images: torch.Tensor, labels: torch.Tensor, args: argparse.Namespace) -> None:
    """Every runner hands the same kind of batch: fail loudly at the first one if not."""
    where = f"{runner.name}: first batch"
    want_dtype = torch.uint8 if runner.counted else torch.float32
    assert isinstance(images, torch.Tensor) and images.dtype == want_dtype, f"{where}: images {images.dtype}"
    assert tuple(images.shape) == (args.batch, 3, SIZE, SIZE), f"{where}: images shape {tuple(images.shape)}"
    assert images.is_contiguous() and images.device.type == "cpu", f"{where}: not a contiguous CPU tensor"
    assert labels.dtype == torch.int64 and tuple(labels.shape) == (args.batch,), f"{where}: labels {labels}"
    assert 0 <= int(labels.min()) and int(labels.max()) < args.classes, (
        f"{where}: labels out of range {labels}"
    )
    values = images.float()
    if images.dtype == torch.uint8:
        assert int(images.max()) >= 200 and int(images.min()) <= 40, f"{where}: uint8 range looks wrong"
        assert 40 < float(values.mean()) < 210, f"{where}: mean pixel {float(values.mean()):.1f}"
    else:
        assert -3.0 < float(values.min()) and float(values.max()) < 3.0, f"{where}: not ImageNet-normalised"
        assert -1.5 < float(values.mean()) < 1.5, f"{where}: mean {float(values.mean()):.2f}"


def _child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children(recursive=True)}


def wait_for_exit(keep: set[int], what: str, timeout: float = 60.0) -> None:
    """Wait until every descendant not in ``keep`` has exited and been reaped, so a runner's
    workers neither linger into the next runner's figures nor land there as reaped CPU time."""
    import multiprocessing

    import psutil

    deadline = time.monotonic() + timeout
    while True:
        multiprocessing.active_children()  # reaps finished multiprocessing children
        left = []
        for c in psutil.Process().children(recursive=True):
            if c.pid in keep:
                continue
            try:
                if c.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(c.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                continue
            left.append(c.pid)
        if not left:
            return
        if time.monotonic() > deadline:
            print(f"WARNING: {what}: processes {left} still alive {timeout:.0f}s after the loader closed")
            return
        time.sleep(0.05)


def measure(runner: Runner, args: argparse.Namespace, data: peers_data.PeersData) -> dict[str, Any]:
    gc.collect()
    keep = _child_pids()  # helpers that outlive runners (multiprocessing's resource tracker)
    pss0 = tree_pss()
    sampler = PeakPss()
    t0 = time.perf_counter()
    it = runner.make(args, data)
    try:
        images, labels = next(it)
        first_s = time.perf_counter() - t0
        check_batch(runner, images, labels, args)
        kind = f"{str(images.dtype).removeprefix('torch.')} {tuple(images.shape)}"
        del images, labels
        for _ in range(args.warmup):
            next(it)
        cpu1, t1, own1 = tree_cpu_seconds(), time.perf_counter(), sampler.cpu_seconds()
        n = 0
        for _ in range(args.batches):
            images, _labels = next(it)
            n += images.shape[0]
            del images, _labels
        t2, cpu2 = time.perf_counter(), tree_cpu_seconds() - (sampler.cpu_seconds() - own1)
    finally:
        it.close()
        gc.collect()
        wait_for_exit(keep, runner.name)
    peak = sampler.stop()
    return {
        "img_s": n / (t2 - t1),
        "cpu_ms_img": (cpu2 - cpu1) * 1000 / n,
        "cores": (cpu2 - cpu1) / (t2 - t1),
        "first_s": first_s,
        "peak_pss_mib": peak / 2**20,
        "start_pss_mib": pss0 / 2**20,
        "images": n,
        "output": kind,
    }


# -------------------------------------------------------------------------------------- reporting

MEASURES = (  # key, column title, higher is better
    ("img_s", "steady img/s", True),
    ("cpu_ms_img", "CPU ms / img", False),
    ("first_s", "first batch s", False),
    ("peak_pss_mib", "peak PSS MiB", False),
)


def summarise(rounds: list[dict[str, dict[str, Any]]], runners: list[Runner]) -> list[dict[str, Any]]:
    rows = []
    for r in runners:
        done = [rnd[r.name] for rnd in rounds if r.name in rnd]
        if not done:
            continue
        row: dict[str, Any] = {"runner": r.name, "label": r.label, "peer": r.peer, "counted": r.counted}
        for key, _, _ in MEASURES:
            row[key] = statistics.median(d[key] for d in done)
        row["cores"] = statistics.median(d["cores"] for d in done)
        row["rounds"] = len(done)
        row["output"] = done[0]["output"]
        if r.counted and row["output"].startswith("float32"):
            row["label"] += " [ran float32: ImageDecode has no uint8 output yet]"
        rows.append(row)
    peers = [row for row in rows if row["peer"]]
    for key, _, higher in MEASURES:
        if not peers:
            break
        best = max(p[key] for p in peers) if higher else min(p[key] for p in peers)
        for row in rows:
            if higher:
                row[f"x_{key}"] = row[key] / best if best else float("inf")
            else:
                row[f"x_{key}"] = best / row[key] if row[key] else float("inf")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    has_ratio = any("x_img_s" in r for r in rows)
    head = ["runner"]
    for _, title, _ in MEASURES:
        head += [title] + (["x best peer"] if has_ratio else [])
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in rows:
        cells = [r["label"]]
        for key, _, _ in MEASURES:
            cells.append(f"{r[key]:.0f}" if key in ("img_s", "peak_pss_mib") else f"{r[key]:.2f}")
            if has_ratio:
                cells.append(f"{r[f'x_{key}']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's bar: ours (uint8) >= 1.3x the best peer in img/s and CPU per image; float32 at
    least the best peer's uint8 img/s."""
    out = []
    for r in rows:
        if r["peer"] or "x_img_s" not in r:
            continue
        if r["counted"]:
            ok = r["x_img_s"] >= 1.3 and r["x_cpu_ms_img"] >= 1.3
            out.append(
                f"{r['runner']}: {r['x_img_s']:.2f}x best peer img/s, {r['x_cpu_ms_img']:.2f}x CPU/img "
                f"-> {'meets' if ok else 'below'} the 1.3x bar"
            )
        else:
            out.append(
                f"{r['runner']}: {r['x_img_s']:.2f}x best peer's uint8 img/s "
                f"-> {'meets' if r['x_img_s'] >= 1.0 else 'below'} the 1.0x bar"
            )
    return out


# ------------------------------------------------------------------------------------------- main


def available(runner: Runner) -> str | None:
    """None when the runner's packages import, else why not."""
    import importlib

    for mod in runner.needs:
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            return f"{mod} missing ({exc})"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=4000, help="JPEGs in the data set (default 4000)")
    p.add_argument("--classes", type=int, default=50, help="classes of the data set (default 50)")
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds; figures are medians (default 3)"
    )
    p.add_argument("--batches", type=int, default=60, help="steady batches per runner and round (default 60)")
    p.add_argument("--warmup", type=int, default=3, help="batches after the first one not timed (default 3)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--workers", type=int, default=2, help="worker processes / DALI threads (default 2)")
    p.add_argument("--dir", default=None, help="data cache folder (default benchmarks/out/peers-data-IMAGES)")
    p.add_argument(
        "--only", default=None, help="comma-separated runners: " + ",".join(r.name for r in RUNNERS)
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dali-tuned",
        type=json.loads,
        default={},
        help=f"JSON overriding dali-tuned's settings (default {json.dumps(DALI_TUNED)}; also fast_idct)",
    )
    p.add_argument("--json", default=None, help="write all rounds and the summary to this file")
    p.add_argument("--smoke", action="store_true", help="tiny run: 96 images, batch 16, 2 batches, 1 round")
    args = p.parse_args(argv)
    args.dali_tuned = {**DALI_TUNED, **args.dali_tuned}
    allowed = {"fused_cmn", "queue_depth", "reader_prefetch", "exec_dynamic", "fast_idct"}
    if set(args.dali_tuned) - allowed:
        p.error(
            f"--dali-tuned: unknown keys {sorted(set(args.dali_tuned) - allowed)}; known {sorted(allowed)}"
        )
    args.smoke_tmp = None
    if args.smoke:
        args.images, args.classes, args.batch, args.batches, args.warmup, args.rounds = 96, 4, 16, 2, 1, 1
    if args.dir is None:
        if args.smoke:
            args.dir = args.smoke_tmp = tempfile.mkdtemp(prefix="bench-peers-smoke-")
        else:
            args.dir = str(Path(__file__).parent / "out" / f"peers-data-{args.images}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    finally:
        if args.smoke_tmp:  # a smoke run's own temporary data set
            shutil.rmtree(args.smoke_tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    runners = list(RUNNERS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = set(names) - {r.name for r in RUNNERS}
        if unknown:
            raise SystemExit(
                f"--only: unknown runner(s) {sorted(unknown)}; known: {[r.name for r in RUNNERS]}"
            )
        runners = [r for r in RUNNERS if r.name in names]
    skipped = {r.name: why for r in runners if (why := available(r))}
    for name, why in skipped.items():
        print(f"skipping {name}: {why}")
    runners = [r for r in runners if r.name not in skipped]

    data = peers_data.prepare(
        args.dir, args.images, classes=args.classes, seed=args.seed, workers=args.workers
    )
    print(f"[data] {peers_data.describe(data.stats)}")
    print(f"[data] {data.folder} (ImageFolder), {len(data.tars)} tar shards + .idx in {data.shards}")
    warm = peers_data.warm_page_cache(data)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"[setup] page cache warmed ({warm / 1e6:.0f} MB); {cpus} cores; workers {args.workers}; "
        f"batch {args.batch}; {args.rounds} rounds x ({args.warmup} warm-up + {args.batches} steady batches)"
    )
    base_pss = tree_pss() / 2**20
    rounds: list[dict[str, dict[str, Any]]] = []
    for rnd in range(args.rounds):
        order = runners if rnd % 2 == 0 else runners[::-1]
        results: dict[str, dict[str, Any]] = {}
        for r in order:
            res = measure(r, args, data)
            results[r.name] = res
            print(
                f"round {rnd + 1}/{args.rounds} {r.name:>16}: {res['img_s']:7.1f} img/s, "
                f"{res['cpu_ms_img']:5.2f} CPU ms/img ({res['cores']:.2f} cores), first batch "
                f"{res['first_s']:5.2f}s, peak PSS {res['peak_pss_mib']:6.0f} MiB  [{res['output']}]",
                flush=True,
            )
        rounds.append(results)

    rows = summarise(rounds, runners)
    print()
    print(f"Data: {peers_data.describe(data.stats)}; page cache warm")
    print(
        f"{cpus} cores, {args.workers} workers, batch {args.batch}, median of {args.rounds} rounds of "
        f"{args.batches} steady batches; this process's own PSS before any runner: {base_pss:.0f} MiB"
    )
    print()
    print(markdown(rows))
    print()
    for line in [*verdict(rows), *NOTES]:
        print(line)
    if args.json:
        versions = {"python": platform.python_version(), "torch": torch.__version__}
        for mod in ("torchvision", "nvidia.dali", "simplejpeg", "PIL"):
            try:
                versions[mod] = __import__(mod, fromlist=["__version__"]).__version__
            except ImportError:
                versions[mod] = None
        report = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "data": data.stats,
            "cores": cpus,
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "smoke_tmp")},
            "versions": versions,
            "base_pss_mib": base_pss,
            "rounds": rounds,
            "summary": rows,
            "verdict": verdict(rows),
            "notes": NOTES,
            "skipped": skipped,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
