"""The standard ImageNet training recipe on PIL, written without torchvision, so every CPU loader
the harness compares (torch, webdataset, stallfree's per-sample path) does the same work per sample:
decode JPEG -> random resized crop -> horizontal flip -> float tensor normalised by ImageNet stats.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
import torch
from PIL import Image

from stallfree.errors import SampleDecodeError
from stallfree.gpu_decode.augment import random_resized_crop
from stallfree.shards.fields import IMAGE_FIELDS

_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def image_field(sample: dict[str, Any]) -> str:
    """The name of the sample's encoded-image field. None is bad data (a sample cut short by a
    truncated tar arrives without its image): SampleDecodeError naming the key and what it has."""
    for name in IMAGE_FIELDS:
        if name in sample:
            return name
    fields = ", ".join(sorted(k for k in sample if not k.startswith("__"))) or "none"
    raise SampleDecodeError(
        f"no image field (looked for {', '.join(IMAGE_FIELDS)}; it has {fields})", key=sample.get("__key__")
    )


def label_of(sample: dict[str, Any]) -> int:
    """The integer label from ``cls`` (ASCII decimal bytes in tar, an int in Arrow); 0 when absent."""
    value = sample.get("cls", 0)
    if isinstance(value, (bytes, bytearray)):
        return int(value.decode("ascii").strip() or 0)
    if isinstance(value, np.ndarray):
        return int(value.reshape(-1)[0])
    return int(value)


def train_transform(img: Image.Image, size: int, rng: np.random.Generator) -> torch.Tensor:
    """RandomResizedCrop(size) + RandomHorizontalFlip + ToTensor + Normalize on a PIL image.

    The crop box comes from ``gpu_decode.augment`` (torchvision's sampling), the one ImageDecode uses.
    """
    img = img.convert("RGB")
    left, top, w, h = random_resized_crop(img.width, img.height, rng)
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
        self._rng: np.random.Generator | None = None

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed * 1_000_003 + os.getpid())
        name = image_field(sample)
        try:
            image = train_transform(Image.open(io.BytesIO(sample[name])), self.size, self._rng)
        except (OSError, ValueError) as exc:  # PIL: truncated or not an image at all
            raise SampleDecodeError(f"cannot decode {name}: {exc}", key=sample.get("__key__")) from exc
        return image, label_of(sample)

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed, "_rng": None}


def collate_pairs(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Stack (image, label) pairs into ``{"image": [N,3,S,S], "label": [N]}``."""
    return {
        "image": torch.stack([x for x, _ in items]),
        "label": torch.tensor([y for _, y in items], dtype=torch.long),
    }
