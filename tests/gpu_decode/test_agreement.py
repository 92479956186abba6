"""How far the DALI-free CPU path is from DALI's CPU pipeline, on the same boxes.

Both crop the same box and resample it with an antialiased bilinear ("triangle") filter; they
differ in the filter's implementation (PIL vs DALI, rounding included) and in that the CPU path
decodes large JPEGs at a reduced DCT scale first. Measured on this suite's photos (pixel units,
0-255, mean over all pixels) when written: eval 224 -> PIL 0.23, simplejpeg 1.04 (its default
chroma upsampling differs from libjpeg-turbo's inside PIL/DALI); eval 64 (heavy DCT scaling) ->
PIL 0.96, simplejpeg 1.22; train 224 -> PIL 0.21, simplejpeg 0.60. The bounds below leave room
for library updates while catching a real mismatch (a shifted box, swapped channels, a missed
flip or a wrong mean/std each give tens of units).
"""

from __future__ import annotations

import pytest
import torch

from stallfree.gpu_decode.augment import IMAGENET_STD
from stallfree.gpu_decode.select import ImageDecode

from .conftest import samples_from

STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def _pixels_mad(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()) * STD).abs().mean())


@pytest.mark.parametrize(("lib", "bound"), [("pil", 0.6), ("simplejpeg", 2.0)])
@pytest.mark.parametrize("train", [False, True])
def test_cpu_path_agrees_with_dali_cpu(rgb_jpegs, lib, bound, train):
    samples = samples_from(rgb_jpegs)
    dali = ImageDecode(train=train, size=224, backend="dali").decode_batch(samples, seed=4)["image"]
    cpu = ImageDecode(train=train, size=224, backend="cpu", jpeg_library=lib).decode_batch(samples, seed=4)
    assert _pixels_mad(dali, cpu["image"]) < bound


def test_cpu_path_agrees_with_dali_cpu_under_dct_scaling(rgb_jpegs):
    samples = samples_from(rgb_jpegs)
    dali = ImageDecode(train=False, size=64, backend="dali").decode_batch(samples, seed=0)["image"]
    cpu = ImageDecode(train=False, size=64, backend="cpu", jpeg_library="pil").decode_batch(samples, seed=0)
    assert _pixels_mad(dali, cpu["image"]) < 2.0


def test_grey_and_cmyk_agree(odd_images):
    for name in ("gray", "cmyk"):
        s = [{"__key__": name, "jpg": odd_images[name]}]
        unlabelled = {"train": False, "size": 224, "label_field": False}
        dali = ImageDecode(backend="dali", **unlabelled).decode_batch(s, seed=0)["image"]
        cpu = ImageDecode(backend="cpu", **unlabelled).decode_batch(s, seed=0)["image"]
        assert _pixels_mad(dali, cpu) < 2.0, name
