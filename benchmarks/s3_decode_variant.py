"""The ``ImageDecode`` variant of ``bench_s3_netns.py``: its JPEG data set and the one decode
recipe every peer runs.

Data: ``--samples`` ImageNet-like JPEGs (``stallfree.testing.images.imagenet_like_jpeg``, the
generator ``bench_peers.py`` uses: ImageNet's size mix, ~95 KB mean, 4:2:0 and 4:4:4 chroma),
written once as ``sNNNNNN.jpg`` + ``sNNNNNN.cls`` into a cache folder and reused by later runs
(the generator is slow on a shared machine; the files are the same for a seed whatever the run).

Transform, the same for every reader: decode to RGB, ``RandomResizedCrop(224, scale 0.08-1,
ratio 3/4-4/3)`` antialiased, horizontal flip with p 0.5, uint8 CHW out, batches stacked to
``[N, 3, 224, 224]``. Ours: ``ImageDecode(train=True, size=224, backend="auto", dtype="uint8")``.
Peers: simplejpeg decode + torchvision v2 crop/flip on the channels-last view, in the loader's
workers (the collate), as ``bench_peers.py``'s fastest peer ("torch-simplejpeg") does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
GENERATOR_VERSION = 1  # bump when the files written below change
MARKER = "dataset.json"


def jpeg_source(cache: Path, n: int, seed: int = 0) -> Path:
    """The folder ``cache/files`` of ``n`` JPEG + label pairs (``stallfree shard``'s "files"
    source), written unless ``cache/dataset.json`` says it holds exactly these."""
    from stallfree.testing.images import imagenet_like_jpeg, jpeg_set_stats, more_photos

    want = {"generator": GENERATOR_VERSION, "images": n, "seed": seed}
    files = cache / "files"
    marker = cache / MARKER
    if marker.exists() and {k: v for k, v in json.loads(marker.read_text()).items() if k in want} == want:
        return files
    files.mkdir(parents=True, exist_ok=True)
    for old in files.iterdir():
        old.unlink()
    photos = more_photos()
    written = []
    for i in range(n):
        data = imagenet_like_jpeg(np.random.default_rng([seed, i]), photos)
        (files / f"s{i:06d}.jpg").write_bytes(data)
        (files / f"s{i:06d}.cls").write_bytes(str(i % 10).encode())
        written.append(data)
    marker.write_text(json.dumps({**want, "stats": jpeg_set_stats(written)}, indent=1))
    return files


def source_stats(cache: Path) -> dict[str, Any]:
    return json.loads((cache / MARKER).read_text())["stats"]


class SimplejpegCropCollate:
    """A batch of samples (``key``/``__key__``, ``jpg``, ``cls``) -> ``{"__key__", "image",
    "label"}``: simplejpeg decode, then v2 random-resized-crop + flip on the HWC array's CHW view
    (channels-last strides, which torch's uint8 antialiased resize takes fastest), stacked."""

    def __init__(self) -> None:
        from torchvision.transforms import v2

        self.ops = v2.Compose(
            [v2.RandomResizedCrop(SIZE, scale=SCALE, ratio=RATIO, antialias=True), v2.RandomHorizontalFlip()]
        )

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        import simplejpeg
        import torch

        images = [
            self.ops(torch.from_numpy(simplejpeg.decode_jpeg(s["jpg"], colorspace="RGB")).permute(2, 0, 1))
            for s in samples
        ]
        return {
            "__key__": [s["__key__"] if "__key__" in s else s["key"] for s in samples],
            "image": torch.stack(images),
            "label": torch.tensor([int(s["cls"]) for s in samples]),
        }


def image_decode() -> Any:
    """Our decoder for the variant (the backend ``auto`` picks: here the CPU one)."""
    from stallfree import ImageDecode

    return ImageDecode(train=True, size=SIZE, backend="auto", dtype="uint8")


def check_batch(batch: dict[str, Any]) -> None:
    """Every reader's decoded batch has the same form: uint8 ``[N, 3, 224, 224]``, N labels."""
    import torch

    image, n = batch["image"], len(batch["__key__"])
    if image.dtype != torch.uint8 or tuple(image.shape) != (n, 3, SIZE, SIZE) or len(batch["label"]) != n:
        raise RuntimeError(
            f"batch of {n}: image {image.dtype} {tuple(image.shape)}, {len(batch['label'])} labels"
        )
