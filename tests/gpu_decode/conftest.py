"""Real-photo test images (scikit-image samples, re-encoded): assorted sizes, grey, CMYK, PNG, bad bytes."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from stallfree.testing.images import base_photos, encode_jpeg, jpeg_bytes, make_image

SIZES = ((500, 375), (375, 500), (320, 240), (1024, 768), (160, 120), (640, 480))


def samples_from(images: list[bytes], prefix: str = "s") -> list[dict]:
    return [
        {"__key__": f"{prefix}{i:04d}", "jpg": b, "cls": str(i % 10).encode()} for i, b in enumerate(images)
    ]


@pytest.fixture(scope="session")
def photos() -> list[np.ndarray]:
    return base_photos()


@pytest.fixture(scope="session")
def rgb_jpegs() -> list[bytes]:
    return jpeg_bytes(12, seed=5, sizes=SIZES)


@pytest.fixture(scope="session")
def odd_images(photos) -> dict[str, bytes]:
    """Valid but unusual inputs: grayscale and CMYK JPEGs, a PNG (with alpha), a progressive JPEG."""
    rng = np.random.default_rng(11)
    gray = encode_jpeg(make_image(rng, photos, (400, 300), "L"))
    cmyk = encode_jpeg(make_image(rng, photos, (300, 400), "CMYK"))
    buf = io.BytesIO()
    make_image(rng, photos, (360, 270), "RGBA").save(buf, format="PNG")
    png = buf.getvalue()
    buf = io.BytesIO()
    make_image(rng, photos, (480, 360)).save(buf, format="JPEG", quality=85, progressive=True)
    return {"gray": gray, "cmyk": cmyk, "png": png, "progressive": buf.getvalue()}


@pytest.fixture(scope="session")
def bad_images(rgb_jpegs) -> dict[str, bytes]:
    """Bytes that must fail: garbage, empty, truncated JPEG and PNG, a JPEG with impossible Huffman tables."""
    good = rgb_jpegs[0]
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(buf, format="PNG")
    png = buf.getvalue()
    return {
        "garbage": b"this is not an image at all, just text" * 4,
        "empty": b"",
        "truncated_jpeg": good[: len(good) * 2 // 3],
        "corrupt_tables": _break_huffman_tables(good),
        "truncated_png": png[: len(png) - 20],
    }


def _break_huffman_tables(jpeg: bytes) -> bytes:
    """Set every code-length count of the first DHT segment to 255: no decoder can build the table."""
    pos = 2
    while jpeg[pos + 1] != 0xC4:
        pos += 2 + int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
    out = bytearray(jpeg)
    out[pos + 5 : pos + 21] = bytes([255] * 16)
    return bytes(out)
