"""Realistic test images: real photographs (scikit-image's bundled samples) re-cropped, resized
and re-encoded, so JPEG decoders see natural statistics rather than flat synthetic colour.

Falls back to smooth synthetic scenes when scikit-image is not installed (the demo must run on a
bare install).
"""

from __future__ import annotations

import io
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

_PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "immunohistochemistry",
    "hubble_deep_field",
    "retina",
    "cat",
)


def base_photos() -> list[np.ndarray]:
    """RGB uint8 photographs to derive test images from."""
    try:
        import skimage.data as data
    except ImportError:
        return [_synthetic_scene(np.random.default_rng(i), 480, 640) for i in range(6)]
    return [np.ascontiguousarray(getattr(data, name)()[..., :3]) for name in _PHOTOS]


def _synthetic_scene(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        fx, fy, ph = rng.uniform(0.005, 0.05, 2).tolist() + [rng.uniform(0, 6.28)]
        img[..., c] = 127 + 100 * np.sin(xx * fx + yy * fy + ph)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image(
    rng: np.random.Generator,
    photos: list[np.ndarray],
    size: tuple[int, int] | None = None,
    mode: str = "RGB",
) -> Image.Image:
    """A random crop of a random photo, resized to ``size`` (w, h) and converted to ``mode``."""
    photo = photos[int(rng.integers(len(photos)))]
    h, w = photo.shape[:2]
    ch, cw = int(rng.integers(h // 2, h + 1)), int(rng.integers(w // 2, w + 1))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    img = Image.fromarray(photo[y : y + ch, x : x + cw])
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if size is not None:
        img = img.resize(size, Image.Resampling.BILINEAR)
    return img.convert(mode) if mode != "RGB" else img


def encode_jpeg(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def jpeg_bytes(
    n: int,
    *,
    seed: int = 0,
    sizes: tuple[tuple[int, int], ...] = ((500, 375), (640, 480), (375, 500), (320, 240)),
    quality: int = 90,
) -> list[bytes]:
    """``n`` JPEG-encoded RGB photos of assorted ImageNet-like sizes, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    photos = base_photos()
    return [
        encode_jpeg(make_image(rng, photos, sizes[int(rng.integers(len(sizes)))]), quality) for _ in range(n)
    ]


def make_image_folder(
    root: str | Path,
    *,
    classes: int = 4,
    per_class: int = 8,
    seed: int = 0,
    sizes: tuple[tuple[int, int], ...] = ((500, 375), (640, 480), (375, 500), (320, 240)),
    quality: int = 90,
) -> Path:
    """An ImageFolder tree ``root/class_XX/img_XXXXX.jpg`` of real-photo JPEGs; returns ``root``."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    photos = base_photos()
    for c in range(classes):
        d = root / f"class_{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = make_image(rng, photos, sizes[int(rng.integers(len(sizes)))])
            (d / f"img_{c:02d}_{i:05d}.jpg").write_bytes(encode_jpeg(img, quality))
    return root


# ImageNet-like data sets ----------------------------------------------------------------------
# ILSVRC-2012 train: most images have a 500 px long side (500x375, 375x500, 500x333 dominate), with
# a tail of larger and smaller ones; mean about 400x350 px and 110 KB; most are 4:2:0 JPEGs, some
# 4:4:4. (width, height), weight.
IMAGENET_SIZE_MIX: tuple[tuple[tuple[int, int], float], ...] = (
    ((500, 375), 0.40),
    ((375, 500), 0.12),
    ((500, 333), 0.14),
    ((333, 500), 0.04),
    ((500, 500), 0.04),
    ((500, 400), 0.04),
    ((500, 281), 0.02),
    ((640, 480), 0.04),
    ((800, 600), 0.03),
    ((1024, 768), 0.02),
    ((1280, 960), 0.01),
    ((400, 300), 0.04),
    ((300, 225), 0.03),
    ((250, 188), 0.03),
)
_REF_PIXELS = 500 * 375
_BYTES_EXPONENT = 0.8  # bytes grow a little slower than pixels (bigger photos are smoother per pixel)
_BYTES_SIGMA = 0.3  # log-normal spread of the per-image byte target


def more_photos() -> list[np.ndarray]:
    """``base_photos`` plus scikit-image's stereo motorcycle pair (two more detailed colour scenes)."""
    photos = base_photos()
    try:
        import skimage.data as data

        left, right, _ = data.stereo_motorcycle()
    except (ImportError, AttributeError):
        return photos
    return [*photos, np.ascontiguousarray(left[..., :3]), np.ascontiguousarray(right[..., :3])]


def _pick_size(rng: np.random.Generator, mix: Sequence[tuple[tuple[int, int], float]]) -> tuple[int, int]:
    weights = np.array([w for _, w in mix], dtype=np.float64)
    return mix[int(rng.choice(len(mix), p=weights / weights.sum()))][0]


def _expected_size_factor(mix: Sequence[tuple[tuple[int, int], float]]) -> float:
    """E[(pixels / 500x375) ** exponent] over the size mix times E[lognormal], so the byte target's
    scale can be solved for the mean file size asked for."""
    total = sum(w for _, w in mix)
    size_term = sum(w * ((sw * sh) / _REF_PIXELS) ** _BYTES_EXPONENT for (sw, sh), w in mix) / total
    return size_term * math.exp(_BYTES_SIGMA**2 / 2)


def photo_like(rng: np.random.Generator, photos: list[np.ndarray], size: tuple[int, int]) -> np.ndarray:
    """A ``size`` (w, h) RGB uint8 view of a random photo: a random crop of the target's aspect
    (25-100% of the photo's area), a random flip, colour jitter (brightness, contrast, saturation,
    white balance) and sensor-like grain, so no two images share pixels."""
    w, h = size
    photo = photos[int(rng.integers(len(photos)))]
    ph, pw = photo.shape[:2]
    aspect = w / h
    area = rng.uniform(0.25, 1.0) * ph * pw
    cw = min(pw, math.sqrt(area * aspect))
    ch = min(ph, cw / aspect)
    cw = ch * aspect
    cw, ch = min(cw, pw), min(ch, ph)
    x0, y0 = rng.uniform(0, max(0.0, pw - cw)), rng.uniform(0, max(0.0, ph - ch))
    img = Image.fromarray(photo).resize(size, Image.Resampling.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    # photos from cameras are sharper than these (often upscaled) crops: restore some fine detail
    img = img.filter(ImageFilter.UnsharpMask(radius=1.5, percent=int(rng.integers(60, 200)), threshold=1))
    a = np.asarray(img, dtype=np.float32)
    grey = a.mean(axis=2, keepdims=True)
    a = grey + (a - grey) * rng.uniform(0.7, 1.3)  # saturation
    a = (a - a.mean()) * rng.uniform(0.75, 1.25) + a.mean() * rng.uniform(0.8, 1.2)  # contrast, brightness
    a *= rng.uniform(0.9, 1.1, size=3).astype(np.float32)  # white balance
    a += rng.standard_normal(a.shape, dtype=np.float32) * np.float32(rng.uniform(2.0, 6.0))  # grain
    return np.clip(a, 0, 255).astype(np.uint8)


def encode_to_bytes(
    pixels: np.ndarray,
    target_bytes: int,
    *,
    subsampling: str = "4:2:0",
    qualities: tuple[int, int] = (60, 98),
) -> tuple[bytes, int]:
    """The JPEG of ``pixels`` whose size is closest to ``target_bytes`` over the quality range
    (bisection: size grows with quality), and the quality used."""
    img = Image.fromarray(pixels)
    lo, hi = qualities
    best: tuple[int, bytes, int] | None = None
    while lo <= hi:
        q = (lo + hi) // 2
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=q, subsampling=subsampling)
        data = buf.getvalue()
        miss = abs(len(data) - target_bytes)
        if best is None or miss < best[0]:
            best = (miss, data, q)
        if len(data) < target_bytes:
            lo = q + 1
        else:
            hi = q - 1
    assert best is not None
    return best[1], best[2]


def imagenet_like_jpeg(
    rng: np.random.Generator,
    photos: list[np.ndarray],
    *,
    mean_kb: float = 95.0,
    share_444: float = 0.2,
    mix: Sequence[tuple[tuple[int, int], float]] = IMAGENET_SIZE_MIX,
) -> bytes:
    """One JPEG with ImageNet-like statistics: a size drawn from ``mix``, a byte target drawn so
    the set's mean is about ``mean_kb`` KB (1000 bytes), 4:4:4 chroma with probability ``share_444``
    (else 4:2:0), the quality chosen to hit the target."""
    size = _pick_size(rng, mix)
    scale = mean_kb * 1000 / _expected_size_factor(mix)
    target = scale * (size[0] * size[1] / _REF_PIXELS) ** _BYTES_EXPONENT * rng.lognormal(0.0, _BYTES_SIGMA)
    subsampling = "4:4:4" if rng.random() < share_444 else "4:2:0"
    data, _ = encode_to_bytes(photo_like(rng, photos, size), int(target), subsampling=subsampling)
    return data


def jpeg_subsampling(data: bytes) -> str:
    """``"4:4:4"``, ``"4:2:2"``, ``"4:2:0"`` or ``"other"`` from a JPEG's frame header."""
    from PIL import JpegImagePlugin

    with Image.open(io.BytesIO(data)) as img:
        kind = JpegImagePlugin.get_sampling(img)
    return {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}.get(kind, "other")


def _facts(data: bytes) -> tuple[int, int, int, str]:
    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
    return width, height, len(data), jpeg_subsampling(data)


def jpeg_set_stats(files: Sequence[bytes]) -> dict[str, Any]:
    """Mean width, height and size (KB = 1000 bytes) and chroma-subsampling shares of a JPEG set."""
    return _stats([_facts(d) for d in files])


def _stats(facts: Sequence[tuple[int, int, int, str]]) -> dict[str, Any]:
    n = max(1, len(facts))
    sizes = [f[2] for f in facts]
    chroma = Counter(f[3] for f in facts)
    return {
        "images": len(facts),
        "mean_width": sum(f[0] for f in facts) / n,
        "mean_height": sum(f[1] for f in facts) / n,
        "mean_kb": sum(sizes) / n / 1000,
        "min_kb": min(sizes, default=0) / 1000,
        "max_kb": max(sizes, default=0) / 1000,
        "subsampling": {k: v / n for k, v in sorted(chroma.items())},
    }


def _imagenet_like_file(job: tuple[str, int, int, int, float, float]) -> tuple[int, int, int, str]:
    """Write image ``i`` of a folder (its own random stream, so any worker count gives the same files)."""
    root, i, classes, seed, mean_kb, share_444 = job
    rng = np.random.default_rng([seed, i])
    data = imagenet_like_jpeg(rng, _photos_cached(), mean_kb=mean_kb, share_444=share_444)
    d = Path(root) / f"class_{i % classes:03d}"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"img_{i:06d}.jpg").write_bytes(data)
    return _facts(data)


_PHOTO_CACHE: list[np.ndarray] = []


def _photos_cached() -> list[np.ndarray]:
    if not _PHOTO_CACHE:
        _PHOTO_CACHE.extend(more_photos())
    return _PHOTO_CACHE


def make_imagenet_like_folder(
    root: str | Path,
    images: int,
    *,
    classes: int = 50,
    seed: int = 0,
    mean_kb: float = 95.0,
    share_444: float = 0.2,
    workers: int = 1,
) -> dict[str, Any]:
    """An ImageFolder tree ``root/class_XXX/img_XXXXXX.jpg`` of ``images`` ImageNet-like JPEGs
    (``imagenet_like_jpeg``), round-robin over ``classes``; the same files for a ``seed`` whatever
    ``workers`` (processes) write them. Returns ``jpeg_set_stats`` of what was written."""
    jobs = [(str(root), i, classes, seed, mean_kb, share_444) for i in range(images)]
    if workers <= 1:
        facts = [_imagenet_like_file(j) for j in jobs]
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            facts = pool.map(_imagenet_like_file, jobs, chunksize=16)
    return _stats(facts)
