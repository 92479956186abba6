"""DALI "mixed" (nvJPEG / hardware decoder) on the GPU: device, shapes, dtypes, ranges, agreement with CPU."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode.augment import IMAGENET_STD
from stallfree.gpu_decode.select import ImageDecode
from stallfree.testing.images import base_photos, encode_jpeg, jpeg_bytes, make_image


def _missing() -> str | None:
    if not torch.cuda.is_available():
        return f"needs CUDA (torch {torch.__version__} sees no GPU); run benchmarks/gpu_check.sh on a GPU machine"
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return "needs NVIDIA DALI: pip install stallfree[dali]"
    return None


_REASON = _missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    images = jpeg_bytes(16, seed=3, sizes=((500, 375), (375, 500), (1024, 768), (320, 240)))
    rng = np.random.default_rng(5)
    photos = base_photos()
    images.append(encode_jpeg(make_image(rng, photos, (400, 300), "L")))
    images.append(encode_jpeg(make_image(rng, photos, (300, 400), "CMYK")))
    buf = io.BytesIO()
    make_image(rng, photos, (320, 240)).save(buf, format="PNG")
    images.append(buf.getvalue())
    return [{"__key__": f"g{i:03d}", "jpg": b, "cls": str(i).encode()} for i, b in enumerate(images)]


def test_auto_picks_dali_mixed_on_the_current_gpu(samples):
    dec = ImageDecode(train=True, size=224)
    st = dec.stats()
    assert st["backend"] == "dali" and "mixed" in st["reason"]
    out = dec.decode_batch(samples, seed=0)
    dev = torch.device("cuda", torch.cuda.current_device())
    assert out["image"].device == dev and out["label"].device == dev
    assert out["label"].tolist() == list(range(len(samples)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("train", [True, False])
def test_shape_dtype_range(samples, dtype, train):
    out = ImageDecode(train=train, size=224, backend="dali", dtype=dtype, device="cuda").decode_batch(
        samples, seed=1
    )
    img = out["image"]
    assert img.shape == (len(samples), 3, 224, 224) and img.dtype == dtype and img.is_cuda
    f = img.float()
    assert torch.isfinite(f).all() and f.min() >= -2.2 and f.max() <= 2.7 and f.std() > 0.3


@pytest.mark.parametrize("train", [True, False])
def test_gpu_agrees_with_cpu_paths(samples, train):
    gpu = ImageDecode(train=train, size=224, backend="dali", device="cuda").decode_batch(samples, seed=2)[
        "image"
    ]
    dali_cpu = ImageDecode(train=train, size=224, backend="dali", device="cpu").decode_batch(samples, seed=2)[
        "image"
    ]
    ours_cpu = ImageDecode(train=train, size=224, backend="cpu").decode_batch(samples, seed=2)["image"]
    # nvJPEG's IDCT/upsampling differ slightly from libjpeg-turbo's; same boxes, same flips.
    assert float(((gpu.cpu() - dali_cpu) * STD).abs().mean()) < 2.0
    assert float(((gpu.cpu() - ours_cpu) * STD).abs().mean()) < 3.0


def test_deterministic_and_epochs_differ(samples):
    dec = ImageDecode(train=True, size=128, backend="dali", device="cuda")
    a = dec.decode_batch(samples, seed=10)["image"]
    b = ImageDecode(train=True, size=128, backend="dali", device="cuda").decode_batch(samples, seed=10)[
        "image"
    ]
    c = dec.decode_batch(samples, seed=11)["image"]
    assert torch.equal(a, b)
    assert all((a[i] - c[i]).abs().mean() > 1e-3 for i in range(len(samples)))


@pytest.mark.parametrize("load", [0.0, 0.65, 1.0])
def test_hw_decoder_load_is_passed_and_output_unchanged_in_shape(samples, load):
    dec = ImageDecode(train=False, size=96, backend="dali", device="cuda", hw_decoder_load=load)
    assert dec.stats()["hw_decoder_load"] == load
    assert dec.decode_batch(samples, seed=0)["image"].shape == (len(samples), 3, 96, 96)


def test_bad_sample_on_gpu_is_located_and_pipeline_recovers(samples):
    good = samples[0]["jpg"]
    pos = 2
    while good[pos + 1] != 0xC4:
        pos += 2 + int.from_bytes(good[pos + 2 : pos + 4], "big")
    broken = bytearray(good)
    broken[pos + 5 : pos + 21] = bytes([255] * 16)
    batch = [dict(s) for s in samples[:6]]
    batch[4]["jpg"] = bytes(broken)
    batch[1]["jpg"] = good[: len(good) // 2]
    dec = ImageDecode(train=True, size=64, backend="dali", device="cuda")
    with pytest.raises(BatchDecodeError) as info:
        dec.decode_batch(batch, seed=0)
    assert [(p, k) for p, k, _ in info.value.failures] == [(1, "g001"), (4, "g004")]
    rest = [s for i, s in enumerate(batch) if i not in (1, 4)]
    assert dec.decode_batch(rest, seed=0)["image"].shape == (4, 3, 64, 64)


def test_through_the_loader_to_cuda(tmp_path, samples):
    dataloader = pytest.importorskip("stallfree.loader.dataloader")
    from stallfree.shards.open import open_dataset
    from stallfree.shards.writer import ShardWriter

    with ShardWriter(str(tmp_path / "ds"), format="tar", max_samples=8) as w:
        for s in samples:
            w.write(s)
    dec = ImageDecode(train=True, size=64, device="cuda")
    loader = dataloader.DataLoader(
        open_dataset(str(tmp_path / "ds")), batch_size=5, seed=1, decode=dec, device="cuda"
    )
    keys = []
    for batch in loader:
        assert batch["image"].is_cuda and batch["image"].shape[1:] == (3, 64, 64)
        assert batch["label"].tolist() == [int(k[1:]) for k in batch["__key__"]]
        keys += batch["__key__"]
    assert sorted(keys) == sorted(s["__key__"] for s in samples)


def test_png_and_cmyk_decode_to_rgb_on_gpu(samples):
    out = ImageDecode(train=False, size=64, backend="dali", device="cuda").decode_batch(samples[-3:], seed=0)
    assert out["image"].shape == (3, 3, 64, 64)
    with Image.open(io.BytesIO(samples[-2]["jpg"])) as img:
        assert img.mode == "CMYK"
