"""header.probe: sizes and formats of real images, and the truncated / not-an-image rejections."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from stallfree.gpu_decode.header import BadImageError, probe


def _summary(data: bytes) -> tuple[str, int, int, int]:
    info = probe(data)
    return (info.format, info.width, info.height, info.components)


def test_probe_reads_size_and_components(rgb_jpegs, odd_images):
    for data in rgb_jpegs:
        with Image.open(io.BytesIO(data)) as img:
            assert _summary(data) == ("jpeg", *img.size, 3)
    assert _summary(odd_images["gray"])[::3] == ("jpeg", 1)
    assert _summary(odd_images["cmyk"]) == ("jpeg", 300, 400, 4)
    assert _summary(odd_images["png"]) == ("png", 360, 270, 4)
    assert _summary(odd_images["progressive"]) == ("jpeg", 480, 360, 3)


def test_probe_reads_other_formats_through_pil():
    buf = io.BytesIO()
    Image.new("RGB", (33, 17), (1, 2, 3)).save(buf, format="BMP")
    assert _summary(buf.getvalue()) == ("bmp", 33, 17, 0)


def test_probe_skips_exif_thumbnail_eoi(rgb_jpegs):
    # A truncated main image must fail even though the EXIF thumbnail before it ends in FF D9.
    img = Image.open(io.BytesIO(rgb_jpegs[0]))
    thumb = io.BytesIO()
    img.resize((64, 48)).save(thumb, format="JPEG")
    exif = Image.Exif()
    out = io.BytesIO()
    img.save(out, format="JPEG", exif=exif.tobytes() + thumb.getvalue())
    full = out.getvalue()
    assert probe(full).width == img.width
    with pytest.raises(BadImageError, match="truncated JPEG"):
        probe(full[: len(full) - 5000])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("garbage", "not a recognised image format"),
        ("empty", "too short"),
        ("truncated_jpeg", "truncated JPEG"),
        ("truncated_png", "truncated PNG"),
    ],
)
def test_probe_rejects(bad_images, name, message):
    with pytest.raises(BadImageError, match=message):
        probe(bad_images[name])


def test_probe_rejects_header_only_jpeg(rgb_jpegs):
    with pytest.raises(BadImageError, match="truncated JPEG"):
        probe(rgb_jpegs[0][:300])
