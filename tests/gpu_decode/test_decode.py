"""ImageDecode on both CPU-machine backends (DALI CPU operators, DALI-free CPU) on real photos."""

from __future__ import annotations

import sys

import pytest
import torch

from stallfree.errors import BatchDecodeError, SampleDecodeError
from stallfree.gpu_decode.select import ImageDecode

from .conftest import samples_from

BACKENDS = [
    pytest.param({"backend": "dali"}, id="dali-cpu"),
    pytest.param({"backend": "cpu", "jpeg_library": "turbo"}, id="cpu-turbo"),
    pytest.param({"backend": "cpu", "jpeg_library": "pil"}, id="cpu-pil"),
    pytest.param({"backend": "cpu", "jpeg_library": "simplejpeg"}, id="cpu-simplejpeg"),
]


@pytest.fixture(params=BACKENDS)
def backend(request) -> dict:
    return request.param


def _decoder(backend: dict, **kwargs) -> ImageDecode:
    return ImageDecode(size=kwargs.pop("size", 64), num_threads=2, **backend, **kwargs)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shapes_dtypes_labels_keys(backend, rgb_jpegs, train, dtype):
    samples = samples_from(rgb_jpegs)
    dec = _decoder(backend, train=train, dtype=dtype, size=48)
    out = dec.decode_batch(samples, seed=3)
    assert set(out) == {"image", "label", "__key__"}
    assert out["image"].shape == (12, 3, 48, 48) and out["image"].dtype == dtype
    assert out["image"].device == torch.device("cpu")
    assert out["label"].dtype == torch.int64 and out["label"].tolist() == [i % 10 for i in range(12)]
    assert out["__key__"] == [s["__key__"] for s in samples]
    img = out["image"].float()
    # ImageNet-normalised photos: within [-mean/std, (255-mean)/std] and not flat.
    assert img.min() >= -2.2 and img.max() <= 2.7 and img.std() > 0.3
    st = dec.stats()
    assert st["backend"] == backend["backend"] and st["images"] == 12 and st["batches"] == 1
    assert st["preset"] == ("train" if train else "eval")


def test_each_output_belongs_to_its_own_sample(backend, rgb_jpegs):
    """Label alignment: image i of a batch equals sample i decoded alone with the same seed."""
    samples = samples_from(rgb_jpegs[:6])
    dec = _decoder(backend, train=True)
    batch = dec.decode_batch(samples, seed=9)
    for i, s in enumerate(samples):
        alone = dec.decode_batch([s], seed=9)
        assert torch.equal(batch["image"][i], alone["image"][0])
        assert alone["label"].tolist() == [batch["label"][i].item()]


def test_deterministic_under_seed_and_crops_differ_across_epochs(backend, rgb_jpegs):
    samples = samples_from(rgb_jpegs)
    a = _decoder(backend, train=True).decode_batch(samples, seed=1234)["image"]
    b = _decoder(backend, train=True).decode_batch(samples, seed=1234)["image"]
    assert torch.equal(a, b)  # fresh decoder, same seed: identical bytes
    c = _decoder(backend, train=True).decode_batch(samples, seed=1235)["image"]
    differs = [(a[i] - c[i]).abs().mean().item() > 1e-3 for i in range(len(samples))]
    assert all(differs)


def test_eval_ignores_seed(backend, rgb_jpegs):
    samples = samples_from(rgb_jpegs[:4])
    dec = _decoder(backend, train=False)
    assert torch.equal(dec.decode_batch(samples, seed=1)["image"], dec.decode_batch(samples, seed=2)["image"])


def test_grey_cmyk_png_progressive_decode_to_rgb(backend, odd_images, rgb_jpegs):
    names = list(odd_images)
    samples = [{"__key__": n, "jpg" if n != "png" else "png": odd_images[n], "cls": 1} for n in names]
    out = _decoder(backend, train=False).decode_batch(samples, seed=0)
    assert out["image"].shape == (4, 3, 64, 64)
    gray = out["image"][names.index("gray")].float()
    # A grey image becomes R = G = B before normalisation: undo mean/std and compare channels.
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1) * 255
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
    pixels = gray * std + mean
    assert (pixels[0] - pixels[1]).abs().max() < 1.0 and (pixels[1] - pixels[2]).abs().max() < 1.0
    for n in ("cmyk", "png", "progressive"):
        px = out["image"][names.index(n)].float() * std + mean
        assert px.min() > -1 and px.max() < 256 and px.std() > 10  # a real picture, in range


def test_label_field_forms_and_a_missing_label_is_an_error(backend, rgb_jpegs):
    samples = [
        {"__key__": "a", "jpg": rgb_jpegs[0], "cls": b" 7\n"},
        {"__key__": "b", "jpg": rgb_jpegs[1], "cls": 3},
        {"__key__": "c", "jpg": bytearray(rgb_jpegs[2]), "cls": "5"},
        {"__key__": "d", "jpg": memoryview(rgb_jpegs[3]), "cls": 4.0},
    ]
    out = _decoder(backend, train=False).decode_batch(samples, seed=0)
    assert out["label"].tolist() == [7, 3, 5, 4]
    # it was label -1, found only when cross_entropy raised
    samples[3] = {"__key__": "d", "jpg": rgb_jpegs[3], "label": 2, "txt": b"a caption"}
    with pytest.raises(BatchDecodeError) as info:
        _decoder(backend, train=False).decode_batch(samples, seed=0)
    [(pos, key, cause)] = info.value.failures
    assert (pos, key) == (3, "d") and isinstance(cause, SampleDecodeError) and cause.key == "d"
    assert str(cause) == (
        "no label field 'cls' (the default where no bound dataset's manifest names a class_field); "
        "the sample's fields are ['jpg', 'label', 'txt']: pass label_field='label', or label_field=False "
        "to decode without labels (sample 'd')"
    )
    with pytest.raises(
        BatchDecodeError, match=r"no label field 'y' \(label_field\); the sample's fields are"
    ):
        _decoder(backend, train=False, label_field="y").decode_batch(samples, seed=0)


@pytest.mark.parametrize("value", [b"x7", "3.5", 2.5, [1], {"a": 1}])
def test_a_label_that_is_not_an_integer_is_an_error(backend, rgb_jpegs, value):
    with pytest.raises(BatchDecodeError, match="label field 'cls' is not an integer"):
        _decoder(backend).decode_batch([{"__key__": "k", "jpg": rgb_jpegs[0], "cls": value}], seed=0)


def test_unlabelled_decoding_has_no_label(backend, rgb_jpegs):
    out = _decoder(backend, label_field=False).decode_batch([{"__key__": "k", "jpg": rgb_jpegs[0]}], seed=0)
    assert set(out) == {"image", "__key__"}


@pytest.mark.parametrize("bad", ["garbage", "empty", "truncated_jpeg", "truncated_png", "corrupt_tables"])
def test_bad_input_raises_batch_decode_error_naming_the_sample(backend, rgb_jpegs, bad_images, bad):
    samples = samples_from(rgb_jpegs[:5])
    samples[3] = {"__key__": "bad-one", "jpg": bad_images[bad], "cls": b"1"}
    dec = _decoder(backend, train=True)
    with pytest.raises(BatchDecodeError) as info:
        dec.decode_batch(samples, seed=0)
    err = info.value
    assert [(pos, key) for pos, key, _ in err.failures] == [(3, "bad-one")]
    cause = err.failures[0][2]
    assert isinstance(cause, SampleDecodeError) and cause.key == "bad-one"
    assert "'bad-one'" in str(err)
    assert dec.stats()["failures"] == 1
    # The pipeline survives: the loader's "skip" policy decodes the rest again.
    rest = samples[:3] + samples[4:]
    out = dec.decode_batch(rest, seed=0)
    assert out["__key__"] == [s["__key__"] for s in rest]
    full = _decoder(backend, train=True).decode_batch(samples_from(rgb_jpegs[:5]), seed=0)
    assert torch.equal(out["image"], full["image"][[0, 1, 2, 4]])  # crops are per key: unchanged


def test_several_bad_samples_all_reported(backend, rgb_jpegs, bad_images):
    samples = samples_from(rgb_jpegs[:6])
    samples[0]["jpg"] = bad_images["corrupt_tables"]
    samples[2]["jpg"] = bad_images["truncated_jpeg"]
    samples[5] = {"__key__": "nofield", "txt": b"hello"}
    with pytest.raises(BatchDecodeError) as info:
        _decoder(backend, train=False).decode_batch(samples, seed=0)
    assert [(p, k) for p, k, _ in info.value.failures] == [(0, "s0000"), (2, "s0002"), (5, "nofield")]
    assert "no image field" in str(info.value.failures[2][2])


def test_explicit_image_field_and_wrong_type(backend, rgb_jpegs):
    dec = _decoder(backend, train=False, image_field="photo", label_field=False)
    out = dec.decode_batch([{"__key__": "x", "photo": rgb_jpegs[0]}], seed=0)
    assert out["image"].shape == (1, 3, 64, 64)
    with pytest.raises(BatchDecodeError, match="expected encoded image bytes"):
        dec.decode_batch([{"__key__": "y", "photo": 12}], seed=0)


def test_auto_without_cuda_picks_cpu_and_says_why():
    dec = ImageDecode(train=True, size=32)
    st = dec.stats()
    assert st["backend"] == "cpu" and st["device"] == "cpu"
    assert "no CUDA" in st["reason"]
    # the rule names the path it chose and the evidence for it
    assert "region-of-interest C decoder" in st["reason"] and "RESULTS.md" in st["reason"]
    assert st["jpeg_library"] == "turbo"


def test_forcing_dali_without_dali_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    with pytest.raises(
        ImportError, match=r"pip install 'stallfree\[dali-cuda13\]'.*'stallfree\[dali\]' for CUDA 12"
    ):
        ImageDecode(backend="dali")
    assert ImageDecode(backend="auto").stats()["backend"] == "cpu"  # no CUDA here: the CPU decoder


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backend": "tpu"},
        {"dtype": "int8"},
        {"std": (1.0, 0.0, 1.0)},
        {"size": 0},
        {"jpeg_library": "libjpeg"},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        ImageDecode(**{"backend": "cpu", **kwargs})


def test_pickles_after_use_and_decodes_the_same(backend, rgb_jpegs):
    """Spawned workers or a resumed job get a working copy (no thread pool or DALI pipeline in the pickle)."""
    import pickle

    samples = samples_from(rgb_jpegs[:4])
    dec = _decoder(backend, train=True)
    before = dec.decode_batch(samples, seed=5)["image"]
    clone = pickle.loads(pickle.dumps(dec))
    assert torch.equal(clone.decode_batch(samples, seed=5)["image"], before)


def test_top_level_export():
    import stallfree

    assert stallfree.ImageDecode is ImageDecode


def test_bad_label_is_a_sample_failure(backend, rgb_jpegs):
    samples = samples_from(rgb_jpegs[:3])
    samples[1]["cls"] = b"cat"
    with pytest.raises(BatchDecodeError, match="not an integer") as info:
        _decoder(backend).decode_batch(samples, seed=0)
    assert [(p, k) for p, k, _ in info.value.failures] == [(1, "s0001")]


def test_concurrent_calls_from_two_threads(backend, rgb_jpegs):
    from concurrent.futures import ThreadPoolExecutor

    samples = samples_from(rgb_jpegs)
    dec = _decoder(backend, train=True)
    expected = {s: dec.decode_batch(samples, seed=s)["image"] for s in range(4)}
    with ThreadPoolExecutor(2) as pool:
        got = dict(enumerate(pool.map(lambda s: dec.decode_batch(samples, seed=s)["image"], range(4))))
    assert all(torch.equal(got[s], expected[s]) for s in range(4))


def test_uint8_output_normalises_to_the_float_output(backend, rgb_jpegs):
    """Every backend's dtype="uint8" is its float output before normalisation."""
    from stallfree.gpu_decode.normalize import normalize

    samples = samples_from(rgb_jpegs[:6])
    u8 = _decoder(backend, dtype="uint8", size=40).decode_batch(samples, seed=5)["image"]
    f32 = _decoder(backend, size=40).decode_batch(samples, seed=5)["image"]
    assert u8.dtype == torch.uint8 and u8.shape == f32.shape
    assert torch.allclose(normalize(u8), f32, rtol=0, atol=1e-5)


def test_other_fields_pass_through_on_every_backend(backend, rgb_jpegs):
    samples = [
        {"__key__": f"k{i}", "jpg": rgb_jpegs[i], "cls": i, "txt": f"caption {i}".encode(), "id": 100 + i}
        for i in range(3)
    ]
    out = _decoder(backend, train=False).decode_batch(samples, seed=0)
    assert list(out) == ["image", "label", "__key__", "txt", "id"]
    assert out["txt"] == [b"caption 0", b"caption 1", b"caption 2"]
    assert out["id"].dtype == torch.int64 and out["id"].tolist() == [100, 101, 102]
