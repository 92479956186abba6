"""Decode backends by name: where each lives, whether it can run here, and how to install it.

Modelled on fsspec's ``registry.py``: a table of names to ``"module:attribute"`` strings, imported
only when a backend is asked for, so ``import stallfree`` (and every forked loader worker) pays for
no backend it does not use: DALI's import alone costs 0.15 s and 65 MB of RSS. Availability is
asked the same lazy way, through a function that must not import the library itself (a
``find_spec`` check); ``usable`` may go further (nvImageCodec: its native library loads) and is
asked only where the answer decides something (``backend="auto"`` on a GPU, select.py).

A new backend is one file with a class that follows ``backend.Backend`` and one line here (or a
``register_backend`` call from your own code, e.g. in a test).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DALI_HINT = (
    "backend='dali' needs NVIDIA DALI built for torch's CUDA (python -c 'import torch; "
    "print(torch.version.cuda)'): pip install 'stallfree[dali-cuda13]' for CUDA 13 (PyPI's torch), "
    "or 'stallfree[dali]' for CUDA 12"
)
NVIMGCODEC_HINT = (
    "backend='nvimgcodec' needs NVIDIA nvImageCodec and nvJPEG: pip install nvidia-nvimgcodec-cu13 "
    "nvidia-nvjpeg (CUDA 12: nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12)"
)

Ref = str | Callable[..., Any]  # "package.module:attribute", or the object itself


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend. ``target``: its class; ``available``: a cheap check that it is
    installed (None: always); ``usable``: a stricter check that it works (None: ``available``);
    ``install_hint``: the ImportError's message when it is asked for but missing; ``gpu``: it
    takes the rank's CUDA device (``BackendOptions.device_id``; None on a machine without CUDA or
    for ``device="cpu"``); ``without_cuda``: what a GPU backend runs then (for ``stats()["reason"]``)."""

    target: Ref
    available: Ref | None = None
    usable: Ref | None = None
    install_hint: str = ""
    gpu: bool = False
    without_cuda: str = "its CPU path"


_BACKENDS: dict[str, BackendEntry] = {
    "dali": BackendEntry(
        "stallfree.gpu_decode.dali:DaliDecoder",
        "stallfree.gpu_decode.dali:dali_available",
        install_hint=DALI_HINT,
        gpu=True,
        without_cuda="DALI CPU operators",
    ),
    "nvimgcodec": BackendEntry(
        "stallfree.gpu_decode.nvimgcodec:NvImageCodecDecoder",
        "stallfree.gpu_decode.nvimgcodec:nvimgcodec_available",
        "stallfree.gpu_decode.nvimgcodec:nvimgcodec_importable",
        install_hint=NVIMGCODEC_HINT,
        gpu=True,
        without_cuda="nvImageCodec CPU decoders",
    ),
    "cpu": BackendEntry("stallfree.gpu_decode.cpu:CpuDecoder"),
}


def register_backend(name: str, entry: BackendEntry | Ref, *, clobber: bool = False) -> None:
    """Add a backend under ``name`` (a ``BackendEntry``, or just its class or ``"module:Class"``).

    An existing name is an error unless ``clobber``: two packages silently fighting over one name
    would make ``ImageDecode(backend=name)`` depend on import order."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"a backend name must be a non-empty string other than 'auto', got {name!r}")
    if name in _BACKENDS and not clobber:
        raise ValueError(f"decode backend {name!r} is already registered (pass clobber=True to replace it)")
    _BACKENDS[name] = entry if isinstance(entry, BackendEntry) else BackendEntry(entry)


def backend_names() -> tuple[str, ...]:
    """Every registered name, in registration order (the built-ins first)."""
    return tuple(_BACKENDS)


def entry(name: str) -> BackendEntry:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend must be {_choices()}, got {name!r}") from None


def available(name: str) -> bool:
    """Whether ``name`` is installed here, without importing the library it wraps."""
    check = entry(name).available
    return True if check is None else bool(_resolve(check)())


def usable(name: str) -> bool:
    """Whether ``name`` is installed and works here (may import the library: ask only when it decides)."""
    e = entry(name)
    if not available(name):
        return False
    return True if e.usable is None else bool(_resolve(e.usable)())


def backend_class(name: str) -> type:
    """The backend's class, imported now; ImportError with the install hint if it is missing."""
    e = entry(name)
    if not available(name):
        raise ImportError(e.install_hint or f"decode backend {name!r} is not installed")
    try:
        return _resolve(e.target)
    except ImportError as exc:
        raise ImportError(f"{e.install_hint or f'decode backend {name!r} does not import'} ({exc})") from exc


def _resolve(ref: Ref) -> Any:
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _choices() -> str:
    names = [repr(n) for n in ("auto", *_BACKENDS)]
    return ", ".join(names[:-1]) + f" or {names[-1]}"
