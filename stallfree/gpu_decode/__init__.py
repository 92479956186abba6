"""Image decode + augment for the loader's ``decode=``: DALI (GPU "mixed" or CPU) or a DALI-free CPU path.

``ImageDecode`` (select.py) is the entry point; backend.py is the contract every backend follows
(``Backend``, ``OutputSpec``, ``BackendOptions``), registry.py finds them by name
(``register_backend`` adds one); dali.py, nvimgcodec.py and cpu.py are the built-in backends,
augment.py draws the crop boxes they share, header.py reads sizes and refuses what no decoder
should see; jpeg_info.py says which JPEG decoder the CPU backend uses (``jpeg_decoder()``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Backend",
    "BackendOptions",
    "ImageDecode",
    "JpegDecoder",
    "OutputSpec",
    "jpeg_decoder",
    "register_backend",
]

_LAZY = {  # lazy: importing the package must not import torch or DALI
    "ImageDecode": "stallfree.gpu_decode.select",
    "Backend": "stallfree.gpu_decode.backend",
    "BackendOptions": "stallfree.gpu_decode.backend",
    "OutputSpec": "stallfree.gpu_decode.backend",
    "register_backend": "stallfree.gpu_decode.registry",
    "jpeg_decoder": "stallfree.gpu_decode.jpeg_info",
    "JpegDecoder": "stallfree.gpu_decode.jpeg_info",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stallfree.gpu_decode' has no attribute {name!r}")
