"""Which JPEG decoder the CPU backend uses here, and why: ``jpeg_decoder()``.

The region-of-interest C decoder (``_turbo.c``) is an optional extension: a build without a C
compiler or libjpeg-turbo's headers goes on without it (setup.py, ``optional=True``), and the CPU
decoder then falls back to PIL, several times slower per image at ImageNet sizes. That must be
visible before a run, not found in ``stats()`` after one, so ``stallfree --version``, ``stallfree
doctor`` and the benchmark headers print this report. Kept apart from cpu.py, which imports torch:
asking which decoder is present must stay cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

TURBO_MODULE = "stallfree.gpu_decode._turbo"
INSTALL_HINT = "install gcc and libjpeg62-turbo-dev, then reinstall stallfree"


@dataclasses.dataclass(frozen=True)
class JpegDecoder:
    """``name``: ``"turbo"`` (the C region-of-interest decoder) or ``"pil"`` (the fallback);
    ``reason``: why (the library it was built against, or the import error and how to fix it)."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


@functools.lru_cache(maxsize=1)
def jpeg_decoder() -> JpegDecoder:
    """The JPEG decoder ``ImageDecode``'s CPU backend uses with ``jpeg_library="auto"`` (the
    default) in this install. Imports neither torch nor PIL."""
    try:
        turbo = importlib.import_module(TURBO_MODULE)
    except ImportError as exc:
        return JpegDecoder(
            "pil",
            f"the C extension {TURBO_MODULE} is not built ({exc}): {INSTALL_HINT}",
        )
    version = getattr(turbo, "LIBJPEG_VERSION", None)
    built = f" against libjpeg API {version}" if version is not None else ""
    return JpegDecoder(
        "turbo",
        f"the C region-of-interest decoder {TURBO_MODULE} is built{built} and loaded",
    )


__all__ = ["INSTALL_HINT", "JpegDecoder", "jpeg_decoder"]
