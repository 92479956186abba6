"""nvImageCodec backend: auto's choice (runs anywhere), the CPU decoders (nvImageCodec installed),
and on a GPU: device, shapes, dtypes, agreement with the CPU backend, uint8 vs float, bad samples."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode import registry, select
from stallfree.gpu_decode.augment import IMAGENET_MEAN, IMAGENET_STD, Preset
from stallfree.gpu_decode.backend import BackendOptions, OutputSpec
from stallfree.gpu_decode.dali import dali_available
from stallfree.gpu_decode.header import probe
from stallfree.gpu_decode.normalize import normalize
from stallfree.gpu_decode.nvimgcodec import NvImageCodecDecoder, nvimgcodec_importable
from stallfree.gpu_decode.select import ImageDecode
from stallfree.testing.images import base_photos, encode_jpeg, jpeg_bytes, make_image

_NO_CODEC = (
    None
    if nvimgcodec_importable()
    else "needs NVIDIA nvImageCodec (nvidia.nvimgcodec does not import): pip install nvidia-nvimgcodec-cu13 "
    "nvidia-nvjpeg, or run benchmarks/gpu_check.sh, which installs them from third_party/wheels"
)
_NO_GPU = (
    f"needs CUDA (torch {torch.__version__} sees no GPU); run benchmarks/gpu_check.sh on a GPU machine"
    if not torch.cuda.is_available()
    else _NO_CODEC
)
needs_codec = pytest.mark.skipif(_NO_CODEC is not None, reason=_NO_CODEC or "")
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(_NO_GPU is not None, reason=_NO_GPU or "")]


def _gpu(fn):
    for mark in needs_gpu:
        fn = mark(fn)
    return fn


# --- auto's rule: monkeypatched availability, so it runs on any machine ------------------------


@pytest.fixture
def world(monkeypatch):
    """Set what is installed and whether CUDA is visible; records whether the import was tried."""
    tried: list[bool] = []

    def set_world(*, cuda: bool, dali: bool, codec: bool) -> list[bool]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        installed = {"dali": dali, "nvimgcodec": codec}

        def importable() -> bool:
            tried.append(True)
            return codec

        for name, present in installed.items():
            fake = registry.entry(name)
            fake = dataclasses.replace(fake, available=lambda present=present: present, usable=importable)
            monkeypatch.setitem(registry._BACKENDS, name, fake)
        return tried

    return set_world


@pytest.mark.parametrize(
    ("cuda", "dali", "codec", "backend", "words"),
    [
        (True, True, True, "dali", ["DALI present", "mixed"]),
        (True, True, False, "dali", ["DALI present"]),
        (True, False, True, "nvimgcodec", ["CUDA device 0", "DALI not installed", "nvImageCodec present"]),
        (True, False, False, "cpu", ["DALI not installed"]),
        (False, False, True, "cpu", ["no CUDA", "CPU decoder"]),
        (False, True, True, "cpu", ["no CUDA"]),
    ],
)
def test_auto_picks_nvimgcodec_only_with_cuda_and_without_dali(world, cuda, dali, codec, backend, words):
    tried = world(cuda=cuda, dali=dali, codec=codec)
    chosen, reason = select._choose("auto", 0)
    assert chosen == backend
    assert reason.startswith("auto: ") and all(w in reason for w in words), reason
    # The import is tried only where its answer decides: CUDA present, DALI absent, nvImageCodec installed.
    assert tried == ([True] if cuda and not dali and codec else [])


def test_auto_on_a_cpu_device_never_picks_nvimgcodec(world):
    world(cuda=True, dali=False, codec=True)
    chosen, reason = select._choose("auto", None)
    assert chosen == "cpu" and reason.startswith("auto: device is the CPU -> CPU decoder"), reason


def test_forced_nvimgcodec(world):
    world(cuda=True, dali=True, codec=True)
    assert select._choose("nvimgcodec", 0) == ("nvimgcodec", "forced by backend='nvimgcodec'")
    world(cuda=False, dali=False, codec=True)
    assert select._choose("nvimgcodec", None) == (
        "nvimgcodec",
        "forced by backend='nvimgcodec' (no CUDA: nvImageCodec CPU decoders)",
    )
    assert select._choose("cpu", 0) == ("cpu", "forced by backend='cpu'")


def test_forced_nvimgcodec_when_missing_says_how_to_install(world):
    world(cuda=True, dali=False, codec=False)
    with pytest.raises(ImportError, match=r"pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg"):
        ImageDecode(backend="nvimgcodec", device=0)
    with pytest.raises(ValueError, match="'auto', 'dali', 'nvimgcodec' or 'cpu'"):
        ImageDecode(backend="nvimg")


# --- test images -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    """Real-photo JPEGs of assorted sizes (4:2:0), a 4:4:4 one, a grayscale JPEG and a PNG with alpha."""
    images = jpeg_bytes(14, seed=7, sizes=((500, 375), (375, 500), (1024, 768), (320, 240), (96, 64)))
    rng = np.random.default_rng(9)
    photos = base_photos()
    buf = io.BytesIO()
    make_image(rng, photos, (480, 360)).save(buf, format="JPEG", quality=90, subsampling=0)
    images.append(buf.getvalue())
    images.append(encode_jpeg(make_image(rng, photos, (400, 300), "L")))
    buf = io.BytesIO()
    make_image(rng, photos, (320, 240), "RGBA").save(buf, format="PNG")
    images.append(buf.getvalue())
    return [{"__key__": f"n{i:03d}", "jpg": b, "cls": str(i).encode()} for i, b in enumerate(images)]


def _huffman_tables_broken(jpeg: bytes) -> bytes:
    """A JPEG whose header still parses but whose first Huffman table cannot be built (its 16
    code-length counts set to 255), so it fails in the decoder rather than in ``header.probe``."""
    i = 2
    while not (jpeg[i] == 0xFF and jpeg[i + 1] == 0xC4):
        i += 2 + int.from_bytes(jpeg[i + 2 : i + 4], "big")
    counts = i + 5  # marker (2), length (2), table class/id (1)
    return jpeg[:counts] + b"\xff" * 16 + jpeg[counts + 16 :]


# --- nvImageCodec's CPU decoders (no GPU needed) ---------------------------------------------------


@needs_codec
@pytest.mark.parametrize("train", [True, False])
def test_cpu_decoders_agree_with_the_cpu_backend(samples, train):
    """The same boxes, resize and flip as the CPU backend (measured 0.1-0.7 mean per image)."""
    ours = ImageDecode(train=train, size=224, backend="nvimgcodec", device="cpu", dtype="uint8")
    assert ours.stats()["backend"] == "nvimgcodec" and ours.stats()["nvimgcodec_backends"] == ["cpu_only"]
    a = ours.decode_batch(samples, seed=3)["image"]
    b = ImageDecode(train=train, size=224, backend="cpu", dtype="uint8").decode_batch(samples, seed=3)[
        "image"
    ]
    assert (
        a.shape == b.shape == (len(samples), 3, 224, 224)
        and a.dtype == torch.uint8
        and a.device.type == "cpu"
    )
    per_image = (a.float() - b.float()).abs().mean(dim=(1, 2, 3))
    assert float(per_image.max()) < 1.5, per_image


@needs_codec
def test_cpu_decoders_report_bad_samples_by_position(samples):
    datas = [s["jpg"] for s in samples[:6]]
    datas[1] = b"not an image, only text " * 8
    datas[4] = _huffman_tables_broken(datas[4])
    infos = [probe(d, None) for d in (samples[i]["jpg"] for i in range(6))]
    boxes = [Preset(size=48).box(info.width, info.height, 0, str(i)) for i, info in enumerate(infos)]
    dec = NvImageCodecDecoder(OutputSpec(48, IMAGENET_MEAN, IMAGENET_STD, torch.float32), BackendOptions())
    out, failures = dec.decode(datas, infos, boxes)
    assert [i for i, _ in failures] == [1, 4]
    assert "cannot read the image's header" in str(failures[0][1])
    assert "could not decode it" in str(failures[1][1])
    assert out.shape == (6, 3, 48, 48) and not out[1].any() and not out[4].any() and out[0].any()


# --- on the GPU --------------------------------------------------------------------------------


@_gpu
@pytest.mark.skipif(
    dali_available(), reason="DALI is installed here: auto picks DALI (tests/gpu/test_gpu_decode.py)"
)
def test_auto_picks_nvimgcodec_on_the_current_gpu(samples):
    dec = ImageDecode(train=True, size=224)
    st = dec.stats()
    assert st["backend"] == "nvimgcodec" and "nvImageCodec GPU decode" in st["reason"]
    assert st["nvimgcodec_backends"] == ["hw_gpu_only", "hybrid_cpu_gpu", "gpu_only", "cpu_only"]
    out = dec.decode_batch(samples, seed=0)
    dev = torch.device("cuda", torch.cuda.current_device())
    assert out["image"].device == dev and out["label"].device == dev
    assert out["label"].tolist() == list(range(len(samples)))


@_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
@pytest.mark.parametrize("train", [True, False])
def test_shape_dtype_device(samples, dtype, train):
    out = ImageDecode(train=train, size=160, backend="nvimgcodec", dtype=dtype, device="cuda").decode_batch(
        samples, seed=1
    )
    img = out["image"]
    assert img.shape == (len(samples), 3, 160, 160) and img.dtype == dtype and img.is_cuda
    f = img.float()
    if dtype == torch.uint8:
        assert f.min() >= 0 and f.max() <= 255 and f.std() > 20
    else:
        assert torch.isfinite(f).all() and f.min() >= -2.2 and f.max() <= 2.7 and f.std() > 0.3


@_gpu
@pytest.mark.parametrize("load", [0.0, 0.65, 1.0])
@pytest.mark.parametrize("train", [True, False])
def test_pixels_close_to_the_cpu_backend(samples, train, load):
    """Same boxes and flips; nvJPEG's IDCT and chroma upsampling differ a little from libjpeg-turbo's,
    and the CPU backend may decode at a reduced DCT scale, so pixels agree within a tolerance. A
    wrong box or a missing flip moves a photo's pixels by tens of levels."""
    gpu = ImageDecode(
        train=train, size=224, backend="nvimgcodec", device="cuda", dtype="uint8", hw_decoder_load=load
    )
    assert gpu.stats()["hw_decoder_load"] == load
    a = gpu.decode_batch(samples, seed=2)["image"]
    b = ImageDecode(train=train, size=224, backend="cpu", dtype="uint8").decode_batch(samples, seed=2)[
        "image"
    ]
    per_image = (a.cpu().float() - b.float()).abs().mean(dim=(1, 2, 3))
    assert float(per_image.mean()) < 3.0, per_image
    assert float(per_image.max()) < 8.0, per_image


@_gpu
def test_cmyk_jpeg_is_decoded_like_the_cpu_backend():
    rng = np.random.default_rng(4)
    cmyk = encode_jpeg(make_image(rng, base_photos(), (300, 400), "CMYK"))
    batch = [{"__key__": "c", "jpg": cmyk}]
    a = ImageDecode(
        train=False, size=128, backend="nvimgcodec", device="cuda", dtype="uint8", label_field=False
    ).decode_batch(batch, seed=0)["image"]
    b = ImageDecode(train=False, size=128, backend="cpu", dtype="uint8", label_field=False).decode_batch(
        batch, seed=0
    )["image"]
    assert float((a.cpu().float() - b.float()).abs().mean()) < 3.0


@_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_uint8_and_float_outputs_agree(samples, dtype):
    """The float output is the uint8 output normalised: pixels are rounded before normalising."""
    u8 = ImageDecode(train=True, size=128, backend="nvimgcodec", device="cuda", dtype="uint8")
    fl = ImageDecode(train=True, size=128, backend="nvimgcodec", device="cuda", dtype=dtype)
    pixels = u8.decode_batch(samples, seed=4)["image"]
    floats = fl.decode_batch(samples, seed=4)["image"]
    assert pixels.dtype == torch.uint8 and floats.dtype == dtype
    expected = normalize(pixels, IMAGENET_MEAN, IMAGENET_STD, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert float((floats.float() - expected.float()).abs().max()) <= tol


@_gpu
def test_bad_samples_are_reported_by_position_and_the_decoder_recovers(samples):
    batch = [dict(s) for s in samples[:6]]
    good = batch[1]["jpg"]
    batch[1]["jpg"] = good[: len(good) // 2]  # truncated: refused by header.probe
    batch[4]["jpg"] = _huffman_tables_broken(batch[4]["jpg"])  # parses, fails in nvImageCodec
    dec = ImageDecode(train=True, size=64, backend="nvimgcodec", device="cuda")
    with pytest.raises(BatchDecodeError) as info:
        dec.decode_batch(batch, seed=0)
    failures = info.value.failures
    assert [(p, k) for p, k, _ in failures] == [(1, "n001"), (4, "n004")]
    assert "nvImageCodec could not decode it" in str(failures[1][2])
    rest = [s for i, s in enumerate(batch) if i not in (1, 4)]
    out = dec.decode_batch(rest, seed=0)["image"]
    assert out.shape == (4, 3, 64, 64) and out.is_cuda


@_gpu
def test_decoder_level_failures_hold_zeros(samples):
    datas = [s["jpg"] for s in samples[:5]]
    infos = [probe(d, None) for d in datas]
    boxes = [Preset(size=32).box(info.width, info.height, 0, str(i)) for i, info in enumerate(infos)]
    datas[0] = b"\xff\xd8 garbage after a start-of-image marker" * 4
    datas[3] = _huffman_tables_broken(datas[3])
    dec = NvImageCodecDecoder(
        OutputSpec(32, IMAGENET_MEAN, IMAGENET_STD, torch.uint8), BackendOptions(device_id=0)
    )
    out, failures = dec.decode(datas, infos, boxes)
    assert [i for i, _ in failures] == [0, 3]
    assert out.is_cuda and not out[0].any() and not out[3].any() and out[1].any()
