"""Datasets the harness runs on: a named spec resolved inside each rank, plus wrappers that make
storage slow or fast on purpose (a sleep per sample; a warm in-memory copy of part of the data).

``resolve_dataset("synthetic:256")`` builds real JPEGs in memory (deterministic, so every rank
sees the same data); any other spec is a shard dataset URL opened with ``stallfree.open_dataset``
(a local path or an fsspec URL such as ``http://``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

Sample = dict[str, Any]


class SyntheticImages:
    """``n`` real-photo JPEG samples (``jpg`` bytes, ``cls`` ASCII label), built lazily per process."""

    def __init__(
        self, n: int, *, size: tuple[int, int] = (160, 120), classes: int = 10, seed: int = 0
    ) -> None:
        if n <= 0:
            raise ValueError(f"synthetic dataset needs a positive sample count, got {n}")
        self.n, self.size, self.classes, self.seed = n, size, classes, seed
        self._jpegs: list[bytes] | None = None

    def _data(self) -> list[bytes]:
        if self._jpegs is None:
            from stallfree.testing.images import jpeg_bytes

            self._jpegs = jpeg_bytes(self.n, seed=self.seed, sizes=(self.size,))
        return self._jpegs

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.n:
            raise IndexError(f"sample index {index} out of range for {self.n} samples")
        return {
            "__key__": f"{index:08d}",
            "jpg": self._data()[index],
            "cls": str(index % self.classes).encode(),
        }

    def get_many(self, indices: Sequence[int]) -> list[Sample]:
        return [self[i] for i in indices]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_jpegs": None}

    @property
    def fingerprint(self) -> str:
        return f"synthetic-{self.n}-{self.size[0]}x{self.size[1]}-{self.seed}"


class SlowDataset:
    """Wraps a dataset and sleeps ``delay_s`` in every ``__getitem__``: a known, injected stall."""

    def __init__(self, base: Any, delay_s: float) -> None:
        self.base, self.delay_s = base, delay_s

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Sample:
        time.sleep(self.delay_s)
        return self.base[index]

    def get_many(self, indices: Sequence[int]) -> list[Sample]:
        return [self[i] for i in indices]


class PartialCache:
    """A warm in-memory copy of a share ``fraction`` of the samples in front of ``base``.

    Admit-until-full, never evict (MinIO-style), pre-filled at construction, so a run sees exactly
    ``fraction`` of its reads served from memory: what the what-if model's cache share ``x`` means.
    ``fill_from`` (the same samples on faster storage) warms it without reading slow storage.
    The cached indices are spread evenly over the dataset (every shard holds its share), so any
    stretch of a run, in any order, sees about that share. A sharded ``base`` stays one to the
    loader (shard sizes, fingerprint, URL are passed through; misses go through its batched reads).
    """

    _PASSTHROUGH = ("shard_sizes", "fingerprint", "url", "manifest", "format")

    def __init__(self, base: Any, fraction: float, fill_from: Any = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"cache fraction must be within [0, 1], got {fraction}")
        source = base if fill_from is None else fill_from
        if len(source) != len(base):
            raise ValueError(f"cache fill source has {len(source)} samples, the dataset {len(base)}")
        self.base, self.fraction = base, fraction
        picked = _spread(base, fraction)
        getter = getattr(source, "get_many", None)
        samples = getter(picked) if getter else [source[i] for i in picked]
        self._memory: dict[int, Sample] = dict(zip(picked, samples, strict=True))
        self.cached = len(picked)
        self.cached_bytes = sum(sample_bytes(s) for s in samples)

    def __getattr__(self, name: str) -> Any:
        if name in PartialCache._PASSTHROUGH:
            return getattr(self.__dict__["base"], name)
        raise AttributeError(name)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> Sample:
        hit = self._memory.get(index)
        return hit if hit is not None else self.base[index]

    def get_many(self, indices: Sequence[int]) -> list[Sample]:
        out: list[Sample | None] = [self._memory.get(i) for i in indices]
        misses = [pos for pos, s in enumerate(out) if s is None]
        if misses:
            getter = getattr(self.base, "get_many", None)
            wanted = [indices[p] for p in misses]
            fetched = getter(wanted) if getter else [self.base[i] for i in wanted]
            for pos, sample in zip(misses, fetched, strict=True):
                out[pos] = sample
        return out  # type: ignore[return-value]


def _spread(base: Any, fraction: float) -> list[int]:
    """Indices to hold: the leading ``fraction`` of every shard (one ranged read per shard to fill)
    when ``base`` is sharded, else every ``1/fraction``-th index."""
    sizes = getattr(base, "shard_sizes", None)
    if sizes:
        picked, start = [], 0
        for size in sizes:
            picked += range(start, start + int(round(size * fraction)))
            start += size
        return picked
    n = len(base)
    return [i for i in range(n) if math.floor((i + 1) * fraction) > math.floor(i * fraction)]


def sample_bytes(sample: Sample) -> int:
    """Payload size of a sample (bytes fields and arrays), as storage would transfer it."""
    total = 0
    for name, value in sample.items():
        if name.startswith("__"):
            continue
        if isinstance(value, (bytes, bytearray, memoryview)):
            total += len(value)
        elif hasattr(value, "nbytes"):
            total += int(value.nbytes)
        elif isinstance(value, str):
            total += len(value.encode())
    return total


def mean_sample_bytes(dataset: Any, probe: int = 32) -> float:
    """Mean payload of up to ``probe`` evenly spaced samples (storage bytes per sample)."""
    n = len(dataset)
    if n == 0:
        raise ValueError("dataset is empty")
    step = max(1, n // probe)
    sizes = [sample_bytes(dataset[i]) for i in range(0, n, step)][:probe]
    return sum(sizes) / len(sizes)


def resolve_dataset(spec: str, storage_options: dict[str, Any] | None = None) -> Any:
    """Open the dataset named by ``spec`` (``synthetic:N[:WxH]`` or a shard dataset URL/path)."""
    if spec.startswith("synthetic:"):
        parts = spec.split(":")
        try:
            n = int(parts[1])
            size = tuple(int(v) for v in parts[2].lower().split("x")) if len(parts) > 2 else (160, 120)
        except ValueError as exc:
            raise ValueError(
                f"bad synthetic dataset spec {spec!r}; expected synthetic:N or synthetic:N:WxH"
            ) from exc
        if len(size) != 2:
            raise ValueError(f"bad synthetic image size in {spec!r}; expected WxH")
        return SyntheticImages(n, size=size)  # type: ignore[arg-type]
    from stallfree.shards.open import open_dataset

    return open_dataset(spec, **(storage_options or {}))
