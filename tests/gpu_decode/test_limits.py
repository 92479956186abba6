"""The pixel limit and the header/data plausibility check (header.probe, called once per image by
ImageDecode.decode_batch), on real photos and on forged headers, for every backend and on_error.

Before these checks, a 160x120 JPEG whose frame header claims 30000x30000 took DALI 40 s and
4.9 GB and came back as a grey image counted as a good sample; a real 12000x8000 JPEG decoded.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stallfree.gpu_decode.header import DEFAULT_MAX_PIXELS, BadImageError, ImageTooLargeError, probe
from stallfree.gpu_decode.select import ImageDecode
from stallfree.shards.writer import ShardWriter
from stallfree.testing.images import base_photos, encode_jpeg, make_image
from tests.zygote import AS_SCRIPT, run_python

CHILD = Path(__file__).with_name("refusal_child.py")
ROOT = Path(__file__).resolve().parents[2]


def forge_jpeg(jpeg: bytes, width: int, height: int) -> bytes:
    """The same file with its frame header (SOF) saying ``width`` x ``height``."""
    pos = 2
    while jpeg[pos + 1] not in (0xC0, 0xC1, 0xC2):
        pos += 2 + int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
    out = bytearray(jpeg)
    struct.pack_into(">HH", out, pos + 5, height, width)
    return bytes(out)


def forge_png(png: bytes, width: int, height: int) -> bytes:
    """The same file with its IHDR saying ``width`` x ``height``, CRC recomputed (a careful forgery)."""
    out = bytearray(png)
    struct.pack_into(">II", out, 16, width, height)
    struct.pack_into(">I", out, 29, zlib.crc32(bytes(out[12:29])))
    return bytes(out)


def png_bytes(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    return base_photos()


# -- header.probe: the floor admits every real image, refuses forged headers -----------------------


def test_floor_admits_real_photos_and_the_cheapest_content(photos):
    """The floor is the coding's own minimum, so no valid file is under it: real photos at any
    quality and subsampling, optimised and progressive; and one-colour images, which cost 2.0 bits
    per block in baseline JPEG (measured; the floor is 1) and sit 0.2 % above deflate's bound."""
    rng = np.random.default_rng(3)
    real = []
    for quality in (5, 50, 95):
        for sub in (0, 2):
            for extra in ({}, {"optimize": True}, {"progressive": True}):
                for mode in ("RGB", "L"):
                    img = make_image(rng, photos, (640, 480), mode)
                    real.append(jpeg(img, quality=quality, subsampling=sub, **extra))
    flat = [
        jpeg(Image.new(mode, (2000, 1500), 0), quality=q, **extra)
        for mode in ("RGB", "L")
        for q in (1, 100)
        for extra in ({"optimize": True}, {"progressive": True})
    ]
    pngs = [
        png_bytes(Image.new("RGB", (2000, 1500), 0), compress_level=9),
        png_bytes(Image.new("1", (4000, 3000), 0), compress_level=9),
        png_bytes(make_image(rng, photos, (400, 300)).convert("P"), compress_level=9),
        png_bytes(make_image(rng, photos, (400, 300), "RGBA")),
    ]
    for data in real + flat + pngs:
        info = probe(data)
        assert 0 < info.min_coded_bytes <= info.coded_bytes
    assert min(probe(d).coded_bytes / probe(d).min_coded_bytes for d in flat) >= 2.0


@pytest.mark.parametrize("progressive", [False, True])
def test_forged_jpeg_size_is_implausible(photos, progressive):
    small = jpeg(
        make_image(np.random.default_rng(1), photos, (160, 120)), quality=90, progressive=progressive
    )
    assert probe(small).min_coded_bytes > 0
    with pytest.raises(
        BadImageError, match=r"implausible jpeg: its header says 4000x3000, which needs at least"
    ):
        probe(forge_jpeg(small, 4000, 3000))


def test_forged_png_size_is_implausible(photos):
    small = png_bytes(make_image(np.random.default_rng(2), photos, (48, 32)))
    with pytest.raises(BadImageError, match=r"implausible png: its header says 2000x2000"):
        probe(forge_png(small, 2000, 2000))


def test_pixel_limit_is_inclusive_and_none_disables_it(photos):
    img = make_image(np.random.default_rng(4), photos, (1200, 800))
    for data, fmt in ((encode_jpeg(img), "jpeg"), (png_bytes(img, compress_level=1), "png")):
        assert probe(data, max_pixels=960_000).pixels == 960_000
        assert probe(data, max_pixels=None).pixels == 960_000
        with pytest.raises(
            ImageTooLargeError, match=rf"{fmt} of 1200x800 = 960,000 pixels is over the limit of 959,999"
        ):
            probe(data, max_pixels=959_999)
    buf = io.BytesIO()
    img.save(buf, format="BMP")  # other formats: the size comes from PIL's header reader
    with pytest.raises(ImageTooLargeError, match="bmp of 1200x800"):
        probe(buf.getvalue(), max_pixels=959_999)


def test_limit_comes_before_the_floor(photos):
    small = encode_jpeg(make_image(np.random.default_rng(5), photos, (160, 120)))
    with pytest.raises(
        ImageTooLargeError, match="30000x30000 = 900,000,000 pixels is over the limit of 89,478,485"
    ):
        probe(forge_jpeg(small, 30000, 30000))


def test_default_limit_is_pils():
    assert DEFAULT_MAX_PIXELS == Image.MAX_IMAGE_PIXELS == 89_478_485
    assert ImageDecode(backend="cpu").max_pixels == DEFAULT_MAX_PIXELS


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1000"])
def test_bad_max_pixels(bad):
    with pytest.raises(ValueError, match="max_pixels must be a positive int or None"):
        ImageDecode(backend="cpu", max_pixels=bad)


# -- every backend, through the real DataLoader, under every on_error ------------------------------

GOOD = [f"good{i}" for i in range(4)]
LIMIT = 5_000_000
BAD = {  # key -> what the refusal says
    "real-jpeg-6mp": "jpeg of 3000x2000 = 6,000,000 pixels is over the limit of 5,000,000",
    "real-png-5mp": "png of 2500x2001 = 5,002,500 pixels is over the limit of 5,000,000",
    "forged-jpeg-30000": "jpeg of 30000x30000 = 900,000,000 pixels is over the limit",
    "forged-jpeg-4mp": "implausible jpeg: its header says 4000x1000",
    "forged-png-4mp": "implausible png: its header says 2000x2000",
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, photos) -> Path:
    """4 good real-photo JPEGs among the 5 refused images of BAD, in one tar shard."""
    rng = np.random.default_rng(9)
    small_jpeg = encode_jpeg(make_image(rng, photos, (160, 120)))
    images = {key: encode_jpeg(make_image(rng, photos, (320, 240))) for key in GOOD}
    images["real-jpeg-6mp"] = encode_jpeg(make_image(rng, photos, (3000, 2000)))
    images["real-png-5mp"] = png_bytes(make_image(rng, photos, (2500, 2001)), compress_level=1)
    images["forged-jpeg-30000"] = forge_jpeg(small_jpeg, 30000, 30000)
    images["forged-jpeg-4mp"] = forge_jpeg(small_jpeg, 4000, 1000)
    images["forged-png-4mp"] = forge_png(png_bytes(make_image(rng, photos, (48, 32))), 2000, 2000)
    root = tmp_path_factory.mktemp("refusals")
    with ShardWriter(str(root), format="tar") as w:
        for key in sorted(images):
            w.write({"__key__": key, "jpg": images[key], "cls": b"1"})
    return root


def run_child(**args) -> dict:
    """One epoch in a process of its own (``python refusal_child.py ARGS``, forked from the test
    zygote: torch imported once; each epoch's RSS growth is measured from its own start). The
    timeout only catches a hang or a decoder that does not refuse (DALI took 40 s on the forged
    30000x30000 header alone on an idle machine)."""
    proc = run_python(AS_SCRIPT, str(CHILD), json.dumps(args), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_children(runs: list[dict]) -> list[dict]:
    """What ``run_child`` gives for each of ``runs``, from one child process running them in turn
    (each epoch's RSS growth measured from its own start), or, where this kernel does not let a
    process reset its peak-RSS mark, from one process each."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        return [run_child(**args) for args in runs]
    proc = run_python(AS_SCRIPT, str(CHILD), json.dumps(runs), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [out["peak_reset"] for out in outs] == [True] * len(runs)
    return outs


_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (DALI mixed decode)")
CASES = [
    pytest.param("cpu", "cpu", 0, id="cpu"),
    pytest.param("cpu", "cpu", 2, id="cpu-2-workers"),
    pytest.param("dali", "cpu", 0, id="dali-cpu-ops"),
    pytest.param("dali", "cuda", 0, id="dali-mixed", marks=[pytest.mark.gpu, _NO_CUDA]),
]


ON_ERROR = ["raise", "skip", "warn"]


@pytest.fixture(scope="module")
def refusal_epochs(refusals):
    """(backend, device, workers, on_error) -> what its epoch gave; one process per backend case
    runs the epochs of every on_error (the first test of a case runs them), not one process each."""
    done: dict[tuple, dict] = {}

    def epoch(backend: str, device: str, workers: int, on_error: str) -> dict:
        if (backend, device, workers, on_error) not in done:
            runs = [
                dict(url=str(refusals), backend=backend, device=device, on_error=mode, num_workers=workers,
                     max_pixels=LIMIT)
                for mode in ON_ERROR
            ]  # fmt: skip
            for mode, out in zip(ON_ERROR, run_children(runs), strict=True):
                done[backend, device, workers, mode] = out
        return done[backend, device, workers, on_error]

    return epoch


@pytest.mark.xdist_group("gpu_decode_limits")  # one worker runs a case's epochs once for its 3 tests
@pytest.mark.parametrize(("backend", "device", "workers"), CASES)
@pytest.mark.parametrize("on_error", ON_ERROR)
def test_refused_images_follow_on_error_and_name_the_key(refusal_epochs, backend, device, workers, on_error):
    out = refusal_epochs(backend, device, workers, on_error)
    if on_error == "raise":
        assert out["keys"] == []
        assert sorted(out["error_keys"]) == sorted(BAD)
        for key, cause in zip(out["error_keys"], out["causes"], strict=True):
            assert BAD[key] in cause and f"(sample {key!r})" in cause
            assert f"{key!r} (SampleDecodeError: {BAD[key]}" in out["error"]
    else:
        assert out["error"] is None
        assert sorted(out["keys"]) == GOOD
        assert out["failed_keys"] == sorted(BAD)
        warned = [w for w in out["warnings"] if w.startswith("skipping sample")]
        if on_error == "warn":
            named = {k for k in BAD for w in warned if f"sample {k!r} (index " in w and BAD[k] in w}
            assert named == set(BAD) and len(warned) == len(BAD)
        else:
            assert warned == []
    if workers == 0:  # no decoder allocated the pixels (the forged 30000x30000 alone needs 2.5 GiB)
        assert out["rss_growth_mib"] < 1024, out["rss_growth_mib"]


@pytest.fixture(scope="module")
def real_12000x8000(tmp_path_factory, photos) -> Path:
    """A real 12000x8000 JPEG and a small one in one tar shard (made once: 96 M pixels to encode)."""
    rng = np.random.default_rng(12)
    root = tmp_path_factory.mktemp("real_12000x8000")
    with ShardWriter(str(root), format="tar") as w:
        w.write(
            {"__key__": "big", "jpg": encode_jpeg(make_image(rng, photos, (12000, 8000)), 75), "cls": b"0"}
        )
        w.write({"__key__": "ok", "jpg": encode_jpeg(make_image(rng, photos, (320, 240))), "cls": b"1"})
    return root


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_decode_limits")  # the shard above is made once, on one worker
@pytest.mark.parametrize("backend", ["cpu", "dali"])
def test_real_12000x8000_jpeg_is_over_the_default_limit(real_12000x8000, backend):
    """96 M pixels, over PIL's 89.5 M: the CPU backend used to decode it (PIL only refuses at twice
    that), DALI too; now both refuse it by its header, with the default max_pixels."""
    common = dict(url=str(real_12000x8000), backend=backend, device="cpu", num_workers=0)
    skipped, raised = run_children([{**common, "on_error": "skip"}, {**common, "on_error": "raise"}])
    assert skipped["keys"] == ["ok"] and skipped["failed_keys"] == ["big"]
    out = raised
    assert out["error_keys"] == ["big"]
    assert "12000x8000 = 96,000,000 pixels is over the limit of 89,478,485" in out["causes"][0]
