"""The standard ImageNet training recipe on PIL, written without torchvision, so every CPU loader
the harness compares (torch, webdataset, stallfree's per-sample path) does the same work per sample:
decode JPEG -> random resized crop -> horizontal flip -> float tensor normalised by ImageNet stats.
"""

from __future__ import annotations

import io
import math
import os
import random
from typing import Any

import numpy as np
import torch
from PIL import Image

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "img", "image")
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def image_field(sample: dict[str, Any]) -> str:
    """The name of the sample's encoded-image field."""
    for name in IMAGE_FIELDS:
        if name in sample:
            return name
    raise KeyError(f"sample {sample.get('__key__', '?')!r} has no image field (looked for {IMAGE_FIELDS})")


def label_of(sample: dict[str, Any]) -> int:
    """The integer label from ``cls`` (ASCII decimal bytes in tar, an int in Arrow); 0 when absent."""
    value = sample.get("cls", 0)
    if isinstance(value, (bytes, bytearray)):
        return int(value.decode("ascii").strip() or 0)
    if isinstance(value, np.ndarray):
        return int(value.reshape(-1)[0])
    return int(value)


def random_resized_crop_box(
    width: int, height: int, rng: random.Random, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box choice: (left, top, w, h); centre crop fallback."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def train_transform(img: Image.Image, size: int, rng: random.Random) -> torch.Tensor:
    """RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor + Normalize on a PIL image."""
    img = img.convert("RGB")
    left, top, w, h = random_resized_crop_box(img.width, img.height, rng)
    img = img.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    return (arr.float().div_(255.0) - _MEAN) / _STD


class PILRecipe:
    """Per-sample ``sample -> (image tensor, label)``: the PIL decode + augment recipe.

    Picklable (loader workers get a copy); each process draws its own augmentation randomness.
    """

    def __init__(self, size: int = 224, seed: int = 0) -> None:
        self.size = size
        self.seed = seed
        self._rng: random.Random | None = None

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        if self._rng is None:
            self._rng = random.Random(self.seed * 1_000_003 + os.getpid())
        img = Image.open(io.BytesIO(sample[image_field(sample)]))
        return train_transform(img, self.size, self._rng), label_of(sample)

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed, "_rng": None}


def collate_pairs(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Stack (image, label) pairs into ``{"image": [N,3,S,S], "label": [N]}``."""
    return {
        "image": torch.stack([x for x, _ in items]),
        "label": torch.tensor([y for _, y in items], dtype=torch.long),
    }
