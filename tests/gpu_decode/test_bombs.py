"""Decode-cost bombs that pass every size check: progressive JPEGs with a scan repeated (each scan
is one more pass over the whole image) and progressive JPEGs whose whole-image coefficient buffers
are huge; and crop boxes that are not numbers. Every backend refuses them by header.probe; the C
decoder also by its own limits (its progress monitor, libjpeg's max_memory_to_use).

Before: a one-colour 8000x8000 progressive JPEG with its last scan repeated took 14.2 s at 279 KB,
50 s at 393 KB (the C decoder and PIL alike); a 9400x9400 4:4:4 progressive file peaked at 736 MB
per decode thread; a NaN box decoded "successfully" into a black image.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from stallfree.errors import BatchDecodeError
from stallfree.gpu_decode import cpu
from stallfree.gpu_decode.dali import dali_available
from stallfree.gpu_decode.header import (
    DEFAULT_MAX_MEMORY,
    DEFAULT_MAX_SCANS,
    ImageTooLargeError,
    TooManyScansError,
    probe,
)
from stallfree.gpu_decode.select import ImageDecode
from stallfree.shards.writer import ShardWriter

from .test_limits import run_child

needs_turbo = pytest.mark.skipif(not cpu.turbo_available(), reason="stallfree's C extension was not built")


def progressive(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", progressive=True, quality=90, **kw)
    return buf.getvalue()


def repeat_last_scan(jpeg: bytes, times: int) -> bytes:
    """The file with its last scan (header and entropy data) written ``times`` more times."""
    last, eoi = jpeg.rfind(b"\xff\xda"), jpeg.rfind(b"\xff\xd9")
    return jpeg[:eoi] + jpeg[last:eoi] * times + jpeg[eoi:]


def insert_before_last_scan(jpeg: bytes, segment: bytes) -> bytes:
    last = jpeg.rfind(b"\xff\xda")
    return jpeg[:last] + segment + jpeg[last:]


def com(payload: bytes) -> bytes:
    return b"\xff\xfe" + (len(payload) + 2).to_bytes(2, "big") + payload


def scans_of(jpeg: bytes) -> int:
    return probe(jpeg, max_scans=None).scans


@pytest.fixture(scope="module")
def flat() -> bytes:
    """One colour, 4:2:0, libjpeg's progressive script (10 scans): the cheapest scans there are."""
    return progressive(Image.new("RGB", (512, 384), (90, 120, 200)))


def test_encoders_scan_counts_pass(flat):
    grey = progressive(Image.new("L", (64, 48), 7))
    assert scans_of(flat) == 10 and scans_of(grey) == 6
    assert probe(repeat_last_scan(flat, DEFAULT_MAX_SCANS - 10)).scans == DEFAULT_MAX_SCANS


def test_scans_of_a_single_scan_file_are_not_counted():
    """libjpeg decodes a baseline file from its first scan and never reads on: repeating its scan
    costs nothing, so probe does not count (or pass over) those files."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (1, 2, 3)).save(buf, format="JPEG")
    repeated = repeat_last_scan(buf.getvalue(), 100)
    assert probe(repeated).scans == 1 and probe(repeated).buffer_bytes == 0
    if cpu.turbo_available():
        out = np.empty((3, 8, 8), np.uint8)
        assert cpu._turbo.decode_into(repeated, 0, 0, 64, 48, 8, False, out, max_scans=1)[0] is True


def test_one_scan_over_the_limit_is_refused_by_probe(flat):
    bomb = repeat_last_scan(flat, DEFAULT_MAX_SCANS - 9)
    with pytest.raises(
        TooManyScansError, match=r"jpeg of 512x384 has 65 scans, over the limit of 64 \(each scan is one more"
    ):
        probe(bomb)
    assert probe(bomb, max_scans=None).scans == 65
    assert probe(bomb, max_scans=65).scans == 65


def test_marker_bytes_inside_a_segment_are_not_scans(flat):
    """The quick count takes every FF DA; the exact walk, run when the quick one is over the limit,
    skips segments by length, as libjpeg does: a comment between scans full of FF DA is one segment."""
    noisy = insert_before_last_scan(flat, com(b"\xff\xda" * 100))
    assert probe(noisy, max_scans=None).scans == 110  # the quick count: an upper bound
    assert probe(noisy).scans == 10  # over the limit, so counted exactly: accepted


def test_a_fake_end_marker_in_a_comment_does_not_hide_scans(flat):
    """Counting only up to the first FF D9 would stop at the comment's; libjpeg reads on."""
    hidden = repeat_last_scan(insert_before_last_scan(flat, com(b"\xff\xd9")), 100)
    with pytest.raises(TooManyScansError, match="has 110 scans"):
        probe(hidden)


@needs_turbo
def test_c_decoder_stops_at_its_scan_limit(flat):
    """The direct API refuses on its own, while decoding (libjpeg's progress monitor)."""
    out = np.empty((3, 16, 16), np.uint8)
    bomb = repeat_last_scan(flat, 3)  # 13 scans
    ok, _d, _w, message = cpu._turbo.decode_into(bomb, 0, 0, 512, 384, 16, False, out, max_scans=12)
    assert ok is False and message.startswith("JPEG with more than 12 scans (max_scans)")
    assert cpu._turbo.decode_into(bomb, 0, 0, 512, 384, 16, False, out, max_scans=13)[0] is True
    assert cpu._turbo.decode_into(bomb, 0, 0, 512, 384, 16, False, out, max_scans=0)[0] is True
    ok, *_, message = cpu._turbo.decode_into(repeat_last_scan(flat, 60), 0, 0, 512, 384, 16, False, out)
    assert ok is False and "more than 64 scans" in message  # the default is header.py's


@pytest.mark.parametrize(
    ("mode", "subsampling", "size"),
    [("RGB", 0, (1000, 700)), ("RGB", 2, (1001, 699)), ("RGB", 1, (333, 257)), ("L", 0, (517, 123))],
)
def test_buffer_bytes_are_libjpegs(mode, subsampling, size):
    """probe's figure is the one the C decoder computes from libjpeg's own block counts; baseline
    files decode in one pass and need none."""
    img = Image.new(mode, size, 128 if mode == "L" else (1, 2, 3))
    kw = {"subsampling": subsampling} if mode == "RGB" else {}
    data = progressive(img, **kw)
    need = probe(data).buffer_bytes
    blocks = math.ceil(size[0] / 8) * math.ceil(size[1] / 8)
    assert blocks * 128 <= need <= blocks * 128 * 3
    baseline = io.BytesIO()
    img.save(baseline, format="JPEG", **kw)
    assert probe(baseline.getvalue()).buffer_bytes == 0
    if not cpu.turbo_available():
        return
    out = np.empty((3, 8, 8), np.uint8)
    ok, *_, message = cpu._turbo.decode_into(data, 0, 0, *size, 8, False, out, max_memory=need - 1)
    assert ok is False and f"JPEG needs {need} bytes of coefficient buffers" in message
    # just enough for our own check: libjpeg's, which also counts its small tables, stops it
    ok, *_, message = cpu._turbo.decode_into(data, 0, 0, *size, 8, False, out, max_memory=need)
    assert ok is False and "needs more than max_memory" in message
    assert cpu._turbo.decode_into(data, 0, 0, *size, 8, False, out, max_memory=need + (1 << 20))[0] is True


def test_progressive_over_max_memory_is_refused_and_baseline_is_not():
    img = Image.new("RGB", (1200, 900), (40, 50, 60))
    data = progressive(img, subsampling=0)
    need = probe(data).buffer_bytes
    with pytest.raises(
        ImageTooLargeError,
        match=rf"progressive jpeg of 1200x900 needs {need:,} bytes of coefficient buffers to decode, "
        rf"over the limit of {need - 1:,} \(ImageDecode\(max_memory=...\)\)",
    ):
        probe(data, max_memory=need - 1)
    assert DEFAULT_MAX_MEMORY == 320 << 20


def test_default_memory_limit_admits_420_at_max_pixels_and_refuses_the_reported_444():
    """From the header alone (no such file is encoded here): a 4:2:0 progressive file at the full
    pixel limit fits; the reported 9400x9400 4:4:4 one (505 MiB) does not."""
    from stallfree.gpu_decode.header import _coefficient_bytes

    assert _coefficient_bytes(9459, 9459, [(2, 2), (1, 1), (1, 1)]) < DEFAULT_MAX_MEMORY
    assert _coefficient_bytes(9400, 9400, [(1, 1)] * 3) == 530_160_000 > DEFAULT_MAX_MEMORY


@pytest.mark.parametrize("library", ["turbo", "pil"])
def test_every_cpu_path_refuses_by_header_and_names_the_sample(flat, library):
    if library == "turbo" and not cpu.turbo_available():
        pytest.skip("stallfree's C extension was not built")
    heavy = progressive(Image.new("RGB", (640, 480), (9, 9, 9)), subsampling=0)
    samples = [
        {"__key__": "ok", "jpg": flat},
        {"__key__": "scans", "jpg": repeat_last_scan(flat, 70)},
        {"__key__": "memory", "jpg": heavy},
    ]
    dec = ImageDecode(
        size=16,
        backend="cpu",
        jpeg_library=library,
        max_memory=probe(heavy).buffer_bytes - 1,
        label_field=False,
    )
    with pytest.raises(BatchDecodeError) as info:
        dec.decode_batch(samples, seed=0)
    causes = {key: str(exc) for _, key, exc in info.value.failures}
    assert sorted(causes) == ["memory", "scans"]
    assert "has 80 scans, over the limit of 64" in causes["scans"]
    assert "progressive jpeg of 640x480 needs" in causes["memory"]
    relaxed = ImageDecode(
        size=16, backend="cpu", jpeg_library=library, max_scans=None, max_memory=None, label_field=False
    )
    assert relaxed.decode_batch(samples, seed=0)["image"].shape == (3, 3, 16, 16)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_limits(bad):
    for name in ("max_scans", "max_memory"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int or None"):
            ImageDecode(backend="cpu", **{name: bad})


@needs_turbo
@pytest.mark.parametrize(
    "box", [(math.nan, 0, 8, 8), (0, math.nan, 8, 8), (0, 0, math.nan, 8), (0, 0, 8, math.inf)]
)
def test_c_decoder_refuses_a_box_that_is_not_finite(flat, box):
    out = np.zeros((3, 8, 8), np.uint8)
    with pytest.raises(ValueError, match=r"x, y, w and h must be finite, got \("):
        cpu._turbo.decode_into(flat, *box, 8, False, out)


@pytest.mark.slow  # a child process per backend: started first
def test_scan_bomb_through_the_loader_for_every_backend(tmp_path, flat):
    """The reported file's shape (one colour, last scan repeated), smaller: refused by its header in
    every backend here, through the real DataLoader, in a subprocess (a decoder that does not
    refuse would spend its time on it instead)."""
    bomb = repeat_last_scan(progressive(Image.new("RGB", (2000, 2000), (90, 120, 200))), 490)
    with ShardWriter(str(tmp_path), format="tar") as w:
        w.write({"__key__": "bomb", "jpg": bomb, "cls": b"0"})
        w.write({"__key__": "ok", "jpg": flat, "cls": b"1"})
    for backend in ["cpu", "dali"] if dali_available() else ["cpu"]:
        out = run_child(url=str(tmp_path), backend=backend, device="cpu", on_error="raise", num_workers=0)
        assert out["error_keys"] == ["bomb"], backend
        assert "jpeg of 2000x2000 has 500 scans, over the limit of 64" in out["causes"][0]
