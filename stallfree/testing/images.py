"""Realistic test images: real photographs (scikit-image's bundled samples) re-cropped, resized
and re-encoded, so JPEG decoders see natural statistics rather than flat synthetic colour.

Falls back to smooth synthetic scenes when scikit-image is not installed (the demo must run on a
bare install).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

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
