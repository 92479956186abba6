"""uint8 pixels -> normalised floats, wherever the batch is (the one-call helper for uint8 output).

Why a helper rather than always normalising at decode: a uint8 batch is a quarter of a float32
one through shared memory and over PCIe, and on the GPU the normalisation is one elementwise
kernel at memory speed, where on the CPU it costs every decode thread a pass over the pixels.
The arithmetic is the CPU decoder's own, ``(x - mean) * (1 / std)`` in float32, so the CPU result
is bit-identical to ``ImageDecode(dtype="float32")``'s and the GPU result within float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .augment import IMAGENET_MEAN, IMAGENET_STD

_constants: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

OUTPUT_DTYPES = (torch.float32, torch.float16, torch.uint8)  # what every decode backend writes


def check_output(
    dtype: torch.dtype, mean: Sequence[float], std: Sequence[float], hw_decoder_load: float = 0.0
) -> None:
    """The argument checks every decode backend makes: one place, one wording."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.uint8, got {dtype}")
    if len(mean) != 3 or len(std) != 3 or any(float(s) <= 0 for s in std):
        raise ValueError("mean and std need 3 values each, std > 0 (0-255 pixel scale)")
    if not 0.0 <= hw_decoder_load <= 1.0:
        raise ValueError(f"hw_decoder_load must be in [0, 1], got {hw_decoder_load}")


def normalize(
    images: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(images - mean) / std`` as ``dtype`` for a uint8 ``[N, 3, H, W]`` (or ``[3, H, W]``) batch,
    on the batch's device and, on CUDA, on the current stream; mean and std on the 0-255 scale."""
    if images.dtype != torch.uint8:
        raise TypeError(f"normalize expects uint8 pixels, got {images.dtype}")
    if images.dim() not in (3, 4) or images.shape[-3] != 3:
        raise ValueError(f"normalize expects [N, 3, H, W] or [3, H, W], got {tuple(images.shape)}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    mean_t, inv_std_t = _tensors(mean, std, images.device)
    out = torch.sub(images, mean_t, alpha=1)  # uint8 - float32 -> float32
    out.mul_(inv_std_t)
    return out if dtype == torch.float32 else out.to(dtype)


def _tensors(
    mean: Sequence[float], std: Sequence[float], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    key = (tuple(float(m) for m in mean), tuple(float(s) for s in std), str(device))
    found = _constants.get(key)
    if found is None:
        check_output(torch.float32, key[0], key[1])
        mean_t = torch.tensor(key[0], dtype=torch.float32).view(3, 1, 1)
        inv_std_t = torch.tensor([1.0 / s for s in key[1]], dtype=torch.float32).view(3, 1, 1)
        found = _constants[key] = (mean_t.to(device), inv_std_t.to(device))
    return found
