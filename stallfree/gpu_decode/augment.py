"""Augmentation parameters, sampled on the host so every backend crops the same box.

Why on the host rather than with DALI's in-graph random operators (``image_random_crop``,
``coin_flip``): DALI seeds its generators once, when the pipeline is built, and then advances
them batch after batch. Our loader owns the order and resume state, and hands ``decode_batch`` a
seed per batch; to make crops a pure function of (that seed, the sample's key) — deterministic,
different every epoch, identical after a mid-epoch resume and identical between the DALI and the
CPU backend — the box and the flip are drawn here and fed into the pipeline as per-sample inputs.
DALI still decodes only the box (``decoders.image_slice`` is the same region-of-interest decode
that ``image_random_crop`` uses).

Train preset: torchvision ``RandomResizedCrop`` semantics — area fraction uniform in ``scale``,
log-uniform aspect ratio in ``ratio``, up to 10 tries, then a centre crop clamped to ``ratio`` —
followed by a horizontal flip with probability ``flip_p``. Eval preset: resize the shorter side
to ``resize_size`` and take the centre ``size`` x ``size``, expressed as one box in the original
image (so it is a single resampling, and an integer box: at most half a pixel from torchvision's
resize-then-crop).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.random  # noqa: F401 - numpy imports it lazily: ~6 ms of a loader's first batch otherwise

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


class Box(NamedTuple):
    """A crop box in the original image's pixels, and whether to mirror it horizontally."""

    x: int
    y: int
    w: int
    h: int
    flip: bool


@dataclass(frozen=True)
class Preset:
    """What to do to every image: output ``size``, train (random crop + flip) or eval (centre)."""

    train: bool = True
    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    resize_size: int | None = None  # eval: shorter side before the centre crop; default size / 0.875

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not (0 < self.scale[0] <= self.scale[1] <= 1):
            raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, got {self.scale}")
        if not (0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"ratio must satisfy 0 < lo <= hi, got {self.ratio}")
        if not (0.0 <= self.flip_p <= 1.0):
            raise ValueError(f"flip_p must be in [0, 1], got {self.flip_p}")
        if self.resize_size is not None and self.resize_size < self.size:
            raise ValueError(f"resize_size ({self.resize_size}) must be >= size ({self.size})")

    @property
    def eval_resize(self) -> int:
        return self.resize_size if self.resize_size is not None else int(round(self.size / 0.875))

    def box(self, width: int, height: int, seed: int, key: str) -> Box:
        """The box for one image; a pure function of (seed, key) in the train preset."""
        if not self.train:
            return centre_box(width, height, self.size, self.eval_resize)
        rng = sample_rng(seed, key)
        x, y, w, h = random_resized_crop(width, height, rng, self.scale, self.ratio)
        return Box(x, y, w, h, bool(rng.random() < self.flip_p))


def sample_rng(seed: int, key: str) -> np.random.Generator:
    """A generator private to one (batch seed, sample key): stable if other samples are dropped."""
    return np.random.default_rng([seed % (1 << 64), zlib.crc32(key.encode("utf-8"))])


def random_resized_crop(
    width: int,
    height: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """(x, y, w, h) drawn as torchvision's ``RandomResizedCrop.get_params`` draws them."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            y = int(rng.integers(0, height - h + 1))
            x = int(rng.integers(0, width - w + 1))
            return x, y, w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    w, h = max(1, min(w, width)), max(1, min(h, height))
    return (width - w) // 2, (height - h) // 2, w, h


def centre_box(width: int, height: int, size: int, resize_size: int) -> Box:
    """The centre ``size`` square after resizing the shorter side to ``resize_size``, in original pixels."""
    side = max(1, min(width, height, int(round(size * min(width, height) / resize_size))))
    return Box((width - side) // 2, (height - side) // 2, side, side, False)
