"""Image decode + augment for the loader's ``decode=``: DALI (GPU "mixed" or CPU) or a DALI-free CPU path.

``ImageDecode`` (select.py) is the entry point; dali.py and cpu.py are the backends, augment.py
draws the crop boxes both share, header.py reads sizes and rejects truncated files.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ImageDecode"]


def __getattr__(name: str) -> Any:
    if name == "ImageDecode":  # lazy: importing the package must not import torch or DALI
        from stallfree.gpu_decode.select import ImageDecode

        return ImageDecode
    raise AttributeError(f"module 'stallfree.gpu_decode' has no attribute {name!r}")
