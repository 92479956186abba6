"""One definition of an image for every backend: the pixels as stored; EXIF orientation is not applied.

Before: DALI applied the EXIF rotation while the crop box was drawn on the stored size, so
orientations 5-8 failed on every image ("cropping window [15..235, 56..276] is not valid for
image dimensions [333 x 251]") and 2-4 gave crops that differed from the CPU backend's (mean
difference 25-28). Here the same photo is written with each of the 8 orientations (only the EXIF
tag differs) and decoded by every backend available on this machine: each must give exactly what
it gives for orientation 1, and the backends must agree with each other.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from stallfree.gpu_decode import cpu
from stallfree.gpu_decode.dali import dali_available
from stallfree.gpu_decode.header import probe
from stallfree.gpu_decode.nvimgcodec import nvimgcodec_importable
from stallfree.gpu_decode.select import ImageDecode
from stallfree.testing.images import base_photos, make_image

ORIENTATION = 0x0112


def with_orientation(img: Image.Image, orientation: int, fmt: str) -> bytes:
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    buf = io.BytesIO()
    img.save(buf, format=fmt, exif=exif.tobytes(), **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


BACKENDS = [
    pytest.param(
        {"backend": "cpu", "jpeg_library": "turbo"},
        id="c-decoder",
        marks=pytest.mark.skipif(not cpu.turbo_available(), reason="stallfree's C extension was not built"),
    ),
    pytest.param({"backend": "cpu", "jpeg_library": "pil"}, id="pil"),
    pytest.param(
        {"backend": "dali"},
        id="dali-cpu",
        marks=pytest.mark.skipif(
            not dali_available(), reason="needs NVIDIA DALI: pip install stallfree[dali]"
        ),
    ),
    pytest.param(
        {"backend": "nvimgcodec"},
        id="nvimgcodec-cpu",
        marks=pytest.mark.skipif(
            not nvimgcodec_importable(), reason="needs nvImageCodec: pip install nvidia-nvimgcodec-cu13"
        ),
    ),
    # on a GPU (benchmarks/gpu_check.sh runs these where one is lent): nvJPEG / the hardware decoder
    pytest.param(
        {"backend": "dali", "device": "cuda"},
        id="dali-mixed",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not (dali_available() and torch.cuda.is_available()), reason="needs CUDA and DALI"
            ),
        ],
    ),
    pytest.param(
        {"backend": "nvimgcodec", "device": "cuda"},
        id="nvimgcodec-gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not (nvimgcodec_importable() and torch.cuda.is_available()),
                reason="needs CUDA and nvImageCodec",
            ),
        ],
    ),
]


@pytest.fixture(scope="module")
def oriented() -> dict[str, list[bytes]]:
    """A 333x251 photo (not square: a rotation would swap its sides), orientations 1-8, JPEG and PNG."""
    img = make_image(np.random.default_rng(8), base_photos(), (333, 251))
    return {fmt: [with_orientation(img, k, fmt) for k in range(1, 9)] for fmt in ("JPEG", "PNG")}


def _decode(kwargs: dict, images: list[bytes], train: bool, size: int = 64) -> torch.Tensor:
    samples = [{"__key__": "photo", "jpg": data} for data in images]  # one key: the same box for all
    dec = ImageDecode(train=train, size=size, dtype="uint8", label_field=False, **{"device": "cpu", **kwargs})
    return dec.decode_batch(samples, seed=3)["image"].cpu()


def test_the_tag_is_there_and_probe_reads_the_stored_size(oriented):
    for fmt, images in oriented.items():
        for k, data in enumerate(images, start=1):
            assert Image.open(io.BytesIO(data)).getexif()[ORIENTATION] == k, fmt
            info = probe(data)
            assert (info.width, info.height) == (333, 251)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("kwargs", BACKENDS)
def test_every_orientation_decodes_as_stored(oriented, kwargs, train):
    for fmt, images in oriented.items():
        out = _decode(kwargs, images, train)
        for k in range(2, 9):
            assert torch.equal(out[k - 1], out[0]), (fmt, k)


@pytest.mark.parametrize("kwargs", BACKENDS[1:])
def test_backends_agree_on_oriented_images(oriented, kwargs):
    """Against the CPU backend (the C decoder where built), within test_agreement.py's bound for
    outputs without DCT scaling (pixel units, mean over all pixels): a rotated or mirrored image
    differs by tens of units."""
    images = oriented["JPEG"]
    ours = _decode({"backend": "cpu"}, images, train=True, size=224)
    other = _decode(kwargs, images, train=True, size=224)
    mad = float((ours.float() - other.float()).abs().mean())
    bound = 3.0 if kwargs.get("device") == "cuda" else 2.0  # nvJPEG: tests/gpu/test_gpu_decode.py's bound
    assert mad < bound, mad
