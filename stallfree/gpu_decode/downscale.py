"""Shard-time downscaling (``stallfree shard --max-side N``, as FFCV does when it writes a data set):
an image whose long side is over ``N`` is decoded, resampled to a long side of exactly ``N`` (aspect
kept) and re-encoded in its own format; an image that already fits keeps its original bytes.

Training then decodes far fewer pixels per sample, which is different work from decoding the
originals (the crops see a smaller image), so a benchmark of it is never a same-work comparison.

It lives here, not in ``shards/``, because every decode must be bounded by ``header.probe`` (the
same refusals as the loader's decoders: truncated, implausible, over ``max_pixels``) and
``shards/`` imports nothing of ours; ``shards/parallel.py`` applies it through its ``transform``
hook, in whichever worker process writes the shard.

Deterministic: the output depends only on the input bytes and the settings (PIL's fixed-point
resampler, libjpeg-turbo / zlib / libwebp with fixed options, no threads, no clock), so a data set
is byte-identical for any ``--workers`` and on every run with the same Pillow build.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any

from PIL import Image, JpegImagePlugin

from stallfree.errors import SampleDecodeError
from stallfree.gpu_decode.header import DEFAULT_MAX_PIXELS, BadImageError, ImageInfo, probe
from stallfree.shards.fields import is_image_field

log = logging.getLogger(__name__)

DEFAULT_QUALITY = 90
RESAMPLE = "lanczos"  # antialiased when shrinking: PIL widens the filter by the scale factor
# Formats we re-encode, as PIL names them for ``save`` (``probe`` reports lower-case names).
_SAVE_AS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "ppm": "PPM", "tiff": "TIFF"}
# Decode a JPEG with libjpeg's DCT scaling to no less than this many times the target first (what
# ``Image.thumbnail``'s ``reducing_gap`` does): most of the pixels are never produced, and the
# resampler still has at least twice the output's resolution to filter from.
_REDUCING_GAP = 2


def target_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """``(w, h)`` with the long side ``max_side`` and the aspect kept (short side rounded half up,
    at least 1). Integer arithmetic, so it is the same on every machine."""
    if width >= height:
        return max_side, max(1, (2 * height * max_side + width) // (2 * width))
    return max(1, (2 * width * max_side + height) // (2 * height)), max_side


@dataclass(frozen=True)
class Downscale:
    """Bound every image field's long side to ``max_side`` pixels; ``quality`` for JPEG and WebP.

    Called as a ``shards.parallel`` sample transform: ``apply(sample)`` returns the sample to
    write and how many of its images were re-encoded; a bad image raises ``SampleDecodeError``
    naming the sample key and field, and the shard run's ``on_error`` decides."""

    max_side: int
    quality: int = DEFAULT_QUALITY
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if isinstance(self.max_side, bool) or not isinstance(self.max_side, int) or self.max_side < 1:
            raise ValueError(f"max_side must be a positive integer, got {self.max_side!r}")
        if (
            isinstance(self.quality, bool)
            or not isinstance(self.quality, int)
            or not 1 <= self.quality <= 100
        ):
            raise ValueError(f"quality must be an integer from 1 to 100, got {self.quality!r}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be positive, got {self.max_pixels!r}")

    def record(self, resized: int) -> dict[str, Any]:
        """What the manifest says was done (``Manifest.transform``)."""
        return {"max_side": self.max_side, "quality": self.quality, "resample": RESAMPLE, "resized": resized}

    def apply(self, sample: dict[str, Any]) -> tuple[dict[str, Any], int]:
        key = str(sample.get("__key__"))
        out: dict[str, Any] | None = None
        changed = 0
        for name, value in sample.items():
            if name.startswith("__") or not is_image_field(name):
                continue
            # A Hugging Face image column is a struct {"bytes": ..., "path": ...}.
            data = value.get("bytes") if isinstance(value, dict) else value
            if not isinstance(data, (bytes, bytearray, memoryview)):
                continue
            new = self.image(data, key=key, field=name)
            if new is None:
                continue
            if out is None:
                out = dict(sample)
            out[name] = {**value, "bytes": new} if isinstance(value, dict) else new
            changed += 1
        return (sample if out is None else out), changed

    def image(
        self, data: bytes | bytearray | memoryview, *, key: str = "?", field: str = "?"
    ) -> bytes | None:
        """The re-encoded image, or None when its long side is at most ``max_side`` (keep the
        original bytes). Raises ``SampleDecodeError`` for an image that is bad, too large, or in
        a format we cannot write."""
        buf = bytes(data)
        try:
            info = probe(buf, self.max_pixels)
        except BadImageError as exc:
            raise SampleDecodeError(f"field {field!r}: {exc}", key=key) from None
        if max(info.width, info.height) <= self.max_side:
            return None
        fmt = _SAVE_AS.get(info.format)
        if fmt is None:
            raise SampleDecodeError(
                f"field {field!r}: cannot re-encode a {info.format} image to fit --max-side {self.max_side}",
                key=key,
            )
        size = target_size(info.width, info.height, self.max_side)
        try:
            img, options = _decode(buf, info, size)
            img = img.resize(size, Image.Resampling.LANCZOS)
            return _encode(img, fmt, self.quality, options)
        except Image.DecompressionBombError as exc:  # PIL's process-wide limit below ours
            raise SampleDecodeError(f"field {field!r}: {exc}", key=key) from None
        except (OSError, SyntaxError, ValueError) as exc:
            raise SampleDecodeError(
                f"field {field!r}: cannot decode {info.format} ({exc})", key=key
            ) from None


def _decode(buf: bytes, info: ImageInfo, size: tuple[int, int]) -> tuple[Image.Image, dict[str, Any]]:
    """Decoded pixels ready to resample (palette and 1-bit images widened, so the resampler
    filters them instead of picking nearest pixels) and the encoder options to keep."""
    img = Image.open(io.BytesIO(buf))
    options: dict[str, Any] = {}
    icc = img.info.get("icc_profile")
    if icc:
        options["icc_profile"] = icc
    if info.format == "jpeg":
        exif = img.info.get("exif")  # kept: its orientation still holds (no rotation, same aspect)
        if exif:
            options["exif"] = exif
        sampling = JpegImagePlugin.get_sampling(img)  # 4:4:4 stays 4:4:4, 4:2:0 stays 4:2:0
        if sampling >= 0:
            options["subsampling"] = sampling
        img.draft(img.mode, (size[0] * _REDUCING_GAP, size[1] * _REDUCING_GAP))
    img.load()
    if img.mode == "1":
        img = img.convert("L")
    elif img.mode in ("P", "PA"):
        img = img.convert("RGBA" if img.mode == "PA" or "transparency" in img.info else "RGB")
    return img, options


def _encode(img: Image.Image, fmt: str, quality: int, options: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    if fmt == "JPEG":
        img.save(out, format=fmt, quality=quality, optimize=False, progressive=False, **options)
    elif fmt == "WEBP":
        img.save(out, format=fmt, quality=quality, method=4, **options)
    elif fmt == "PNG":
        img.save(out, format=fmt, optimize=False, compress_level=6, **options)
    else:
        img.save(out, format=fmt)
    return out.getvalue()
