"""ImageNet-like test JPEGs (stallfree.testing.images): the size mix, chroma, byte targets, and the
same files for any number of writer processes."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from stallfree.testing.images import (
    IMAGENET_SIZE_MIX,
    encode_to_bytes,
    imagenet_like_jpeg,
    jpeg_set_stats,
    jpeg_subsampling,
    make_imagenet_like_folder,
    more_photos,
    photo_like,
)


def _encode(pixels: np.ndarray, quality: int, subsampling: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality, subsampling=subsampling)
    return buf.getvalue()


def test_subsampling_is_read_from_the_frame_header():
    pixels = photo_like(np.random.default_rng(0), more_photos(), (120, 80))
    assert jpeg_subsampling(_encode(pixels, 90, "4:4:4")) == "4:4:4"
    assert jpeg_subsampling(_encode(pixels, 90, "4:2:0")) == "4:2:0"
    assert jpeg_subsampling(_encode(pixels, 90, "4:2:2")) == "4:2:2"


def test_encode_to_bytes_picks_the_quality_closest_to_the_target():
    pixels = photo_like(np.random.default_rng(1), more_photos(), (200, 150))
    sizes = {q: len(_encode(pixels, q, "4:2:0")) for q in range(60, 99)}
    target = (sizes[70] + sizes[95]) // 2
    data, quality = encode_to_bytes(pixels, target, subsampling="4:2:0")
    assert data == _encode(pixels, quality, "4:2:0")
    # bisection over a size that grows with quality finds the best of the qualities it tried;
    # none of the qualities next to it is closer
    miss = abs(len(data) - target)
    assert miss <= abs(sizes[quality - 1] - target) and miss <= abs(sizes[quality + 1] - target)


def test_photo_like_has_the_size_asked_for_and_differs_per_draw():
    photos = more_photos()
    rng = np.random.default_rng(2)
    a, b = photo_like(rng, photos, (500, 333)), photo_like(rng, photos, (500, 333))
    assert a.shape == b.shape == (333, 500, 3) and a.dtype == np.uint8
    assert not np.array_equal(a, b)


def test_imagenet_like_jpegs_follow_the_size_mix_and_chroma_share():
    sizes = {s for s, _ in IMAGENET_SIZE_MIX}
    rng = np.random.default_rng(3)
    files = [imagenet_like_jpeg(rng, more_photos(), share_444=0.5) for _ in range(24)]
    for data in files:
        with Image.open(io.BytesIO(data)) as img:
            assert img.format == "JPEG" and img.mode == "RGB" and img.size in sizes
    stats = jpeg_set_stats(files)
    assert stats["images"] == 24
    assert set(stats["subsampling"]) <= {"4:2:0", "4:4:4"}
    assert abs(sum(stats["subsampling"].values()) - 1.0) < 1e-12
    assert stats["min_kb"] <= stats["mean_kb"] <= stats["max_kb"]


def test_set_stats_are_exact_for_known_files():
    pixels = np.zeros((30, 40, 3), np.uint8)
    a, b = _encode(pixels, 90, "4:4:4"), _encode(pixels[:20, :10], 90, "4:2:0")
    stats = jpeg_set_stats([a, b])
    assert stats["mean_width"] == 25 and stats["mean_height"] == 25
    assert stats["mean_kb"] == (len(a) + len(b)) / 2 / 1000
    assert stats["subsampling"] == {"4:2:0": 0.5, "4:4:4": 0.5}


def test_folder_is_the_same_for_any_worker_count(tmp_path):
    one = make_imagenet_like_folder(tmp_path / "one", 10, classes=3, seed=7, workers=1)
    two = make_imagenet_like_folder(tmp_path / "two", 10, classes=3, seed=7, workers=2)
    assert one == two
    files_one = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.jpg"))
    files_two = sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*.jpg"))
    assert files_one == files_two and len(files_one) == 10
    assert sorted({p.parent.name for p in files_one}) == ["class_000", "class_001", "class_002"]
    for rel in files_one:
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes()
    other = make_imagenet_like_folder(tmp_path / "other", 10, classes=3, seed=8)
    assert other != one
