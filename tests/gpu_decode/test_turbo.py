"""The region-of-interest JPEG decoder (_turbo.c) against PIL's full decode + resize, and the
uint8 output / uint8 transfer paths of ImageDecode against the float path."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode import cpu
from stallfree.gpu_decode.augment import IMAGENET_MEAN, IMAGENET_STD
from stallfree.gpu_decode.normalize import normalize
from stallfree.gpu_decode.select import ImageDecode

from .conftest import samples_from

simplejpeg = pytest.importorskip("simplejpeg", reason="the reference decode uses simplejpeg")

pytestmark = pytest.mark.skipif(not cpu.turbo_available(), reason="stallfree's C extension was not built")


def _reference(data: bytes, box: tuple[int, int, int, int], size: int, flip: bool, denom: int) -> np.ndarray:
    """The whole image at the same DCT scale (simplejpeg: libjpeg-turbo with its accurate DCT and
    fancy upsampling, as ours; PIL's draft switches to the fast DCT), then PIL's BILINEAR with box=."""
    w0, h0 = Image.open(io.BytesIO(data)).size
    pixels = simplejpeg.decode_jpeg(
        data, colorspace="RGB", min_width=-(-w0 // denom), min_height=-(-h0 // denom)
    )
    img = Image.fromarray(pixels)
    assert img.width == -(-w0 // denom)
    fx, fy = img.width / w0, img.height / h0
    x, y, w, h = box
    out = img.resize(
        (size, size), Image.Resampling.BILINEAR, box=(x * fx, y * fy, (x + w) * fx, (y + h) * fy)
    )
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out).transpose(2, 0, 1)


def _turbo(data: bytes, box, size: int, flip: bool, out: np.ndarray | None = None):
    out = np.empty((3, size, size), np.uint8) if out is None else out
    ok, denom, _warnings, message = cpu._turbo.decode_into(data, *box, size, flip, out)
    return ok, denom, message, out


def _boxes(rng: np.random.Generator, w: int, h: int, n: int) -> list[tuple[int, int, int, int]]:
    boxes = [(0, 0, w, h), (w - 17, h - 13, 17, 13), (0, h // 2, w // 3, h - h // 2)]
    for _ in range(n):
        bw, bh = int(rng.integers(8, w + 1)), int(rng.integers(8, h + 1))
        boxes.append((int(rng.integers(0, w - bw + 1)), int(rng.integers(0, h - bh + 1)), bw, bh))
    return boxes


@pytest.mark.parametrize("size", [224, 64, 17])
def test_region_decode_matches_pil_full_decode_and_resize(rgb_jpegs, size):
    rng = np.random.default_rng(size)
    denoms = set()
    for data in rgb_jpegs:
        w, h = Image.open(io.BytesIO(data)).size
        for box in _boxes(rng, w, h, 4):
            flip = bool(rng.integers(2))
            ok, denom, message, out = _turbo(data, box, size, flip)
            assert ok is True, message
            ref = _reference(data, box, size, flip, denom)
            diff = np.abs(out.astype(int) - ref.astype(int))
            # rounding of two 8-bit passes (ours 14-bit taps, vertical first; PIL's 22-bit, horizontal first)
            assert diff.max() <= 4, (box, size, denom)
            assert diff.mean() < 0.3, (box, size, denom)
            denoms.add(denom)
    # DCT scaling was exercised: 1/2 for 224 px out of the 1024 px photos, down to 1/8 for small outputs
    assert denoms >= ({1, 2} if size == 224 else {1, 2, 4, 8})


@pytest.mark.parametrize("kind", ["gray", "progressive"])
def test_gray_and_progressive_jpegs(odd_images, kind):
    data = odd_images[kind]
    w, h = Image.open(io.BytesIO(data)).size
    for box in _boxes(np.random.default_rng(1), w, h, 3):
        ok, denom, message, out = _turbo(data, box, 40, True)
        assert ok is True, message
        assert np.abs(out.astype(int) - _reference(data, box, 40, True, denom).astype(int)).max() <= 4
    if kind == "gray":
        assert np.array_equal(out[0], out[1]) and np.array_equal(out[1], out[2])


def test_cmyk_is_left_to_pil(odd_images):
    ok, _denom, message, _out = _turbo(odd_images["cmyk"], (0, 0, 100, 100), 32, False)
    assert ok is None and "colour space" in message
    dec = ImageDecode(size=32, backend="cpu", jpeg_library="turbo", dtype="uint8", num_threads=1)
    assert dec.decode_batch(samples_from([odd_images["cmyk"]]), seed=0)["image"].shape == (1, 3, 32, 32)


@pytest.mark.parametrize("name", ["garbage", "empty", "corrupt_tables"])
def test_corrupt_data_is_an_error_message_not_a_crash(bad_images, name):
    ok, _denom, message, _out = _turbo(bad_images[name], (0, 0, 50, 50), 32, False)
    assert ok is False and message.startswith("corrupt JPEG (")


def test_a_box_outside_the_image_is_refused(rgb_jpegs):
    w, h = Image.open(io.BytesIO(rgb_jpegs[0])).size
    for box in [(w - 10, 0, 11, 10), (0, h, 5, 5), (0, 0, w + 1, h)]:
        ok, _denom, message, _out = _turbo(rgb_jpegs[0], box, 16, False)
        assert ok is False and "outside the" in message, box


def test_arguments_are_checked():
    out = np.empty((3, 8, 8), np.uint8)
    with pytest.raises(ValueError, match="need 192"):
        cpu._turbo.decode_into(b"x", 0, 0, 4, 4, 8, False, np.empty(10, np.uint8))
    with pytest.raises(ValueError, match="positive"):
        cpu._turbo.decode_into(b"x", 0, 0, 0, 4, 8, False, out)
    with pytest.raises(ValueError, match=r"size must be in \[1, 8192\]"):
        cpu._turbo.decode_into(b"x", 0, 0, 4, 4, 9000, False, out)
    with pytest.raises(TypeError):
        cpu._turbo.decode_into(b"x", 0, 0, 4, 4, 8, False, b"read-only buffer of 192 bytes" * 7)


def test_float_output_is_the_normalised_uint8_output_bit_for_bit(rgb_jpegs):
    mean = [float(m) for m in IMAGENET_MEAN]
    inv_std = [1.0 / float(s) for s in IMAGENET_STD]
    for data in rgb_jpegs[:4]:
        w, h = Image.open(io.BytesIO(data)).size
        box = (10, 20, w * 2 // 3, h // 2)
        u8 = _turbo(data, box, 56, True)[3]
        f32 = np.empty((3, 56, 56), np.float32)
        ok, *_ = cpu._turbo.decode_into(data, *box, 56, True, f32, mean, inv_std)
        assert ok is True
        assert np.array_equal(f32, normalize(torch.from_numpy(u8)).numpy())


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("library", ["turbo", "pil"])
def test_uint8_output_is_the_float_output_before_normalisation(rgb_jpegs, odd_images, train, library):
    samples = samples_from([*rgb_jpegs, odd_images["gray"], odd_images["png"], odd_images["cmyk"]])
    kwargs = {"train": train, "size": 48, "backend": "cpu", "jpeg_library": library, "num_threads": 2}
    u8 = ImageDecode(dtype="uint8", **kwargs).decode_batch(samples, seed=4)
    f32 = ImageDecode(dtype="float32", **kwargs).decode_batch(samples, seed=4)
    assert u8["image"].dtype == torch.uint8 and u8["image"].shape == (len(samples), 3, 48, 48)
    assert torch.equal(normalize(u8["image"]), f32["image"])
    assert u8["label"].tolist() == f32["label"].tolist() and u8["__key__"] == f32["__key__"]


def test_turbo_and_pil_agree_within_interpolation_tolerance(rgb_jpegs):
    samples = samples_from(rgb_jpegs)
    kwargs = {"train": True, "size": 64, "backend": "cpu", "dtype": "uint8", "num_threads": 2}
    ours = ImageDecode(jpeg_library="turbo", **kwargs).decode_batch(samples, seed=1)["image"].int()
    pil = ImageDecode(jpeg_library="pil", **kwargs).decode_batch(samples, seed=1)["image"].int()
    diff = (ours - pil).abs()
    assert diff.float().mean() < 0.5 and diff.max() <= 4


def test_transfer_uint8_needs_finish_and_finish_gives_the_float_batch(rgb_jpegs):
    samples = samples_from(rgb_jpegs[:5])
    kwargs = {"size": 32, "backend": "cpu", "num_threads": 1}
    dec = ImageDecode(dtype="float32", transfer="uint8", **kwargs)
    assert dec.needs_finish
    raw = dec.decode_batch(samples, seed=2)
    assert raw["image"].dtype == torch.uint8
    done = dec.finish(raw)
    assert torch.equal(
        done["image"], ImageDecode(dtype="float32", **kwargs).decode_batch(samples, seed=2)["image"]
    )
    assert not ImageDecode(dtype="float32", **kwargs).needs_finish
    with pytest.raises(ValueError, match="transfer"):
        ImageDecode(transfer="float16", **kwargs)


def test_a_corrupt_jpeg_names_its_sample(bad_images, rgb_jpegs):
    samples = samples_from([rgb_jpegs[0], bad_images["corrupt_tables"]])
    dec = ImageDecode(size=32, backend="cpu", jpeg_library="turbo", dtype="uint8", num_threads=1)
    with pytest.raises(BatchDecodeError) as info:
        dec.decode_batch(samples, seed=0)
    assert [f[1] for f in info.value.failures] == ["s0001"]
