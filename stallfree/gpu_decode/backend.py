"""The decode-backend contract: what ``ImageDecode`` asks of every backend and what it hands them.

Why a contract: ``ImageDecode`` used to know each backend by its class (a name check, a
construction branch, ``use_threads``, two ``decode`` call shapes, per-class stats), so a new
backend took a new file and five edits in select.py, and the three constructors repeated one
prelude of checks. Now a backend is a class with this shape, built from two frozen values, and
found by name in registry.py; ``ImageDecode`` calls only what ``Backend`` declares.

The work split every backend shares: ``ImageDecode.decode_batch`` reads the sample fields, runs
``header.probe`` (the one place images are refused by their header) and draws each crop box
(augment.py); the backend gets only bytes that passed, their ``ImageInfo`` and their boxes, in the
stored pixel grid (no EXIF orientation; see select.py), and returns the batch plus the positions it
could not decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from .augment import Box
from .buffers import BufferPool
from .header import ImageInfo
from .normalize import check_output


@dataclass(frozen=True)
class OutputSpec:
    """What the batch a backend writes looks like: ``[N, 3, size, size]`` of ``dtype``; float dtypes
    hold ``(pixel - mean) / std`` (0-255 scale), uint8 the crop-resized pixels as they are."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size must be a positive int, got {self.size!r}")
        check_output(self.dtype, self.mean, self.std)
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))

    def shape(self, n: int) -> tuple[int, int, int, int]:
        return (n, 3, self.size, self.size)


@dataclass(frozen=True)
class BackendOptions:
    """How a backend should run; each uses the fields that apply to it.

    ``device_id``: the CUDA device, None for the CPU; ``num_threads``: decode threads;
    ``hw_decoder_load``: share of JPEGs for the GPU's hardware decoder (GPU backends);
    ``jpeg_library``: the CPU backend's JPEG decoder; ``reuse_buffers``: CPU output batches kept
    for reuse; ``max_scans`` / ``max_memory``: header.py's limits, for decoders that enforce them
    again while decoding (the C decoder)."""

    device_id: int | None = None
    num_threads: int = 2
    hw_decoder_load: float = 0.65
    jpeg_library: str = "auto"
    reuse_buffers: int = 4
    max_scans: int | None = None
    max_memory: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.hw_decoder_load <= 1.0:
            raise ValueError(f"hw_decoder_load must be in [0, 1], got {self.hw_decoder_load}")
        object.__setattr__(self, "num_threads", max(1, int(self.num_threads)))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.device_id is None else torch.device("cuda", self.device_id)


Failures = list[tuple[int, BaseException]]
Alloc = Callable[..., "torch.Tensor | None"]


@runtime_checkable
class Backend(Protocol):
    """A decode backend, built as ``cls(spec: OutputSpec, options: BackendOptions)``.

    ``runs_in_workers``: true only for a picklable, CPU-only backend that writes into
    ``alloc(shape, dtype)`` (a loader worker's shared slot); GPU backends stay in the main process,
    which owns the device."""

    name: ClassVar[str]
    runs_in_workers: ClassVar[bool]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def decode(
        self,
        datas: Sequence[bytes],
        infos: Sequence[ImageInfo],
        boxes: Sequence[Box],
        *,
        alloc: Alloc | None = None,
    ) -> tuple[torch.Tensor, Failures]:
        """(batch on ``device``, [(position, error)] sorted by position); failed rows hold zeros."""
        ...

    def use_threads(self, n: int) -> None:
        """A loader worker's share of the cores (only called where ``runs_in_workers``)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Backend-specific counters, merged into ``ImageDecode.stats()``."""
        ...

    def close(self) -> None: ...


class BackendBase:
    """The prelude every built-in backend shares: the spec, the options, the reused CPU buffers."""

    name: ClassVar[str] = "base"
    runs_in_workers: ClassVar[bool] = False

    def __init__(self, spec: OutputSpec, options: BackendOptions) -> None:
        self.spec = spec
        self.options = options
        self.buffers = BufferPool(options.reuse_buffers)

    @property
    def device(self) -> torch.device:
        return self.options.device

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def size(self) -> int:
        return self.spec.size

    def use_threads(self, n: int) -> None:
        return None  # main-process backends keep the threads they were built with

    def stats(self) -> dict[str, Any]:
        return {"buffers_reused": self.buffers.reused, "buffers_allocated": self.buffers.allocated}

    def close(self) -> None:
        return None
