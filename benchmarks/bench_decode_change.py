"""Decode + augment before vs after a change to stallfree.gpu_decode, in one process.

Why this shape: the machine is shared and noisy, so "before" and "after" must run side by side,
on the same JPEGs, in the same process, rounds interleaved (order reversed every other round).
The "before" code is the package as it was at ``--base`` (``git archive``), renamed to
``stallfree_before`` (its absolute imports rewritten) and with its own C decoder compiled from
that revision's ``_turbo.c``, so both sides are complete, unmodified builds of their revision.

Measures, per side: ``ImageDecode(backend="cpu", train=True, size=224, dtype="uint8")`` over all
``--images`` ImageNet-like JPEGs (``testing.images.imagenet_like_jpeg``: ImageNet's size mix, ~95
KB, 20 % 4:4:4; ``--progressive``: that share re-encoded progressive) in batches of ``--batch``,
for the C decoder and for PIL: img/s and the process's CPU ms per image (the steadier figure on
a loaded machine); and ``header.probe`` alone (us per image, best of 5 passes), since every
backend runs it on every image. Best and median over ``--rounds`` interleaved rounds.

    .venv/bin/python benchmarks/bench_decode_change.py --base 77a3e47 --images 256 --rounds 5
    .venv/bin/python benchmarks/bench_decode_change.py --base 77a3e47 --images 256 --rounds 5 --progressive 1
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def build_before(base: str, into: Path) -> str:
    """``stallfree`` at ``base`` as the package ``stallfree_before`` in ``into``, C decoder built."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", base, "stallfree"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    pkg = into / "stallfree_before"
    (into / "stallfree").rename(pkg)
    for py in pkg.rglob("*.py"):
        text = py.read_text()
        py.write_text(
            text.replace("stallfree.", "stallfree_before.").replace(
                "import stallfree\n", "import stallfree_before\n"
            )
        )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    include = sysconfig.get_paths()["include"]
    src = pkg / "gpu_decode" / "_turbo.c"
    out = pkg / "gpu_decode" / f"_turbo{suffix}"
    cmd = [
        "gcc",
        "-O3",
        "-fno-strict-aliasing",
        "-fPIC",
        "-shared",
        f"-I{include}",
        str(src),
        "-o",
        str(out),
        "-ljpeg",
    ]
    subprocess.run(cmd, check=True)
    return subprocess.run(
        ["git", "rev-parse", "--short", base], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def images(n: int, seed: int, progressive: float) -> list[bytes]:
    """ImageNet-like JPEGs; a share ``progressive`` of them re-encoded progressive (quality 90)."""
    from PIL import Image

    from stallfree.testing.images import base_photos, imagenet_like_jpeg

    rng = np.random.default_rng(seed)
    photos = base_photos()
    out = []
    for _ in range(n):
        data = imagenet_like_jpeg(rng, photos)
        if rng.random() < progressive:
            buf = io.BytesIO()
            Image.open(io.BytesIO(data)).save(buf, format="JPEG", quality=90, progressive=True)
            data = buf.getvalue()
        out.append(data)
    return out


def run_decode(
    image_decode_cls, samples: list[dict], batch: int, threads: int, library: str
) -> tuple[float, float]:
    """(img/s, CPU ms per image): the CPU time is the process's, all threads, which other jobs on
    a shared machine disturb far less than wall time."""
    dec = image_decode_cls(
        train=True, size=224, backend="cpu", dtype="uint8", num_threads=threads, jpeg_library=library
    )
    dec.decode_batch(samples[:batch], seed=0)  # pool started, buffers allocated
    t0, c0 = time.perf_counter(), time.process_time()
    done = 0
    for b in range(0, len(samples) - batch + 1, batch):
        out = dec.decode_batch(samples[b : b + batch], seed=b)
        done += out["image"].shape[0]
        del out
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    dec.close()
    return done / dt, cpu / done * 1e3


def run_probe(probe, datas: list[bytes], repeats: int = 5) -> float:
    """Best of a few passes: a pass is a few ms, so one preemption would otherwise dominate it."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d in datas:
            probe(d)
        best = min(best, time.perf_counter() - t0)
    return best / len(datas) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the revision before the change (e.g. a commit)")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progressive", type=float, default=0.0, help="share of files re-encoded progressive")
    ap.add_argument("--json", help="write the per-round figures here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="stallfree-before-"))
    base = build_before(args.base, tmp)
    sys.path.insert(0, str(tmp))
    sides = {}
    for label, pkg in ((f"before ({base})", "stallfree_before"), ("after (work tree)", "stallfree")):
        select = importlib.import_module(f"{pkg}.gpu_decode.select")
        header = importlib.import_module(f"{pkg}.gpu_decode.header")
        cpu = importlib.import_module(f"{pkg}.gpu_decode.cpu")
        assert cpu.turbo_available(), f"{pkg}: the C decoder did not build"
        sides[label] = (select.ImageDecode, header.probe)

    datas = images(args.images, args.seed, args.progressive)
    samples = [{"__key__": f"k{i:05d}", "jpg": d, "cls": b"0"} for i, d in enumerate(datas)]
    kb = sum(map(len, datas)) / len(datas) / 1000
    print(
        f"{len(datas)} ImageNet-like JPEGs ({args.progressive:.0%} progressive), mean {kb:.1f} KB; "
        f"batch {args.batch}, {args.threads} threads"
    )
    whats = ("turbo", "turbo-cpu", "pil", "pil-cpu", "probe")
    rows = {(label, what): [] for label in sides for what in whats}
    labels = list(sides)
    for r in range(args.rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            cls, probe = sides[label]
            for lib in ("turbo", "pil"):
                speed, cpu_ms = run_decode(cls, samples, args.batch, args.threads, lib)
                rows[(label, lib)].append(speed)
                rows[(label, f"{lib}-cpu")].append(cpu_ms)
            rows[(label, "probe")].append(run_probe(probe, datas))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    before, after = labels
    print()
    print(
        f"| measure | before, best / median of {args.rounds} | after, best / median | after / before (best; median) |"
    )
    print("|---|---:|---:|---:|")
    units = {
        "turbo": "img/s, C decoder",
        "turbo-cpu": "CPU ms/img, C decoder",
        "pil": "img/s, PIL",
        "pil-cpu": "CPU ms/img, PIL",
        "probe": "us/img, header.probe",
    }
    for what, unit in units.items():
        pick = max if what in ("turbo", "pil") else min  # the round least disturbed by the load
        b, a = rows[(before, what)], rows[(after, what)]
        best_b, best_a, med_b, med_a = pick(b), pick(a), statistics.median(b), statistics.median(a)
        print(
            f"| {unit} | {best_b:.2f} / {med_b:.2f} | {best_a:.2f} / {med_a:.2f} "
            f"| {best_a / best_b:.3f}; {med_a / med_b:.3f} |"
        )
    for what in ("turbo", "pil"):
        ratios = [a / b for a, b in zip(rows[(after, what)], rows[(before, what)], strict=True)]
        print(f"per-round after/before, {what}: " + " / ".join(f"{x:.3f}" for x in ratios))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
