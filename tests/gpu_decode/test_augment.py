"""Host-side crop boxes: torchvision RandomResizedCrop semantics, deterministic per (seed, key)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stallfree.gpu_decode.augment import Box, Preset, centre_box, random_resized_crop


def test_random_resized_crop_within_bounds_scale_and_ratio():
    rng = np.random.default_rng(0)
    fallbacks = 0
    for _ in range(2000):
        w_img, h_img = int(rng.integers(50, 1200)), int(rng.integers(50, 1200))
        x, y, w, h = random_resized_crop(w_img, h_img, rng)
        assert 0 <= x and 0 <= y and 0 < w and 0 < h and x + w <= w_img and y + h <= h_img
        frac, aspect = w * h / (w_img * h_img), w / h
        if frac > 1.0 or not (3 / 4 - 0.05 <= aspect <= 4 / 3 + 0.05):
            fallbacks += 1  # only the clamped centre-crop fallback may leave the aspect range
            assert (x, y) == ((w_img - w) // 2, (h_img - h) // 2)
    assert fallbacks < 100


def test_random_resized_crop_area_distribution_matches_torchvision_sampling():
    rng = np.random.default_rng(1)
    # Fixed area and aspect: the box is sqrt(area * ratio) x sqrt(area / ratio), rounded.
    assert random_resized_crop(1000, 1000, rng, scale=(0.5, 0.5), ratio=(1.0, 1.0))[2:] == (707, 707)
    x, y, w, h = random_resized_crop(1000, 1000, rng, scale=(0.25, 0.25), ratio=(4.0, 4.0))
    assert (w, h) == (1000, 250)
    # Area uniform on (0.08, 1), boxes past the image edge rejected and redrawn: on a square image
    # the large off-square boxes are the rejected ones, so the mean fraction drops below 0.54.
    fracs = [np.prod(random_resized_crop(1000, 1000, rng)[2:]) / 1e6 for _ in range(4000)]
    assert 0.45 < np.mean(fracs) < 0.51
    assert min(fracs) >= 0.079 and max(fracs) <= 1.0


def test_train_box_is_pure_function_of_seed_and_key():
    p = Preset(train=True, size=224)
    assert p.box(500, 375, 7, "a") == p.box(500, 375, 7, "a")
    boxes_by_seed = {p.box(500, 375, s, "a") for s in range(20)}
    assert len(boxes_by_seed) == 20
    assert p.box(500, 375, 7, "a") != p.box(500, 375, 7, "b")
    flips = [p.box(500, 375, s, "k").flip for s in range(400)]
    assert 150 < sum(flips) < 250
    assert not any(Preset(train=True, flip_p=0.0).box(500, 375, s, "k").flip for s in range(50))


def test_eval_box_is_the_centre_square_after_resizing_shorter_side():
    p = Preset(train=False, size=224)
    assert p.eval_resize == 256
    b = p.box(500, 375, 123, "any")
    side = round(224 * 375 / 256)
    assert b == Box((500 - side) // 2, (375 - side) // 2, side, side, False)
    assert p.box(500, 375, 0, "other") == b  # eval ignores seed and key
    assert centre_box(100, 80, 224, 256) == Box(15, 5, 70, 70, False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": 0},
        {"scale": (0.5, 0.1)},
        {"ratio": (0.0, 1.0)},
        {"flip_p": 1.5},
        {"train": False, "resize_size": 100},
    ],
)
def test_preset_validates(kwargs):
    with pytest.raises(ValueError):
        Preset(**kwargs)


def test_fallback_clamps_to_ratio():
    class NeverFits:
        def uniform(self, lo, hi):
            return hi if lo < 0.5 else math.log(100.0)  # huge aspect: every try is rejected

        def integers(self, lo, hi):
            return lo

    assert random_resized_crop(1000, 100, NeverFits()) == (433, 0, 133, 100)
    assert random_resized_crop(100, 1000, NeverFits()) == (0, 433, 100, 133)
    assert random_resized_crop(100, 90, NeverFits()) == (0, 0, 100, 90)
