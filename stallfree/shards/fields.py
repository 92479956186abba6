"""Which fields hold encoded images: defined once, for the sources, verify, decoders and harness."""

from __future__ import annotations

# Image file formats by suffix (what an ImageFolder source ingests and verify --decode decodes).
IMAGE_FORMATS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff")
IMAGE_EXTENSIONS = tuple(f".{f}" for f in IMAGE_FORMATS)
# Field names a sample's image may be under, in the order decoders look for one.
IMAGE_FIELDS = (*IMAGE_FORMATS, "img", "image")


def is_image_field(name: str) -> bool:
    """``name`` (a field, or a tar member ``KEY.FIELD``) holds an encoded image."""
    return name.rsplit(".", 1)[-1].lower() in IMAGE_FIELDS
