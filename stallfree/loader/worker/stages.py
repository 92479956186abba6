"""The per-batch stages a worker runs: fetch raw samples, map (decode/transform), and the
per-sample error capture the loader's ``on_error`` policy works from.

Plain functions of their inputs so they run (and are tested) without processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stallfree.errors import BatchDecodeError
from stallfree.loader import contracts

logger = logging.getLogger(__name__)


class SampleFailure(Exception):
    """One sample failed in a stage; carries the index, the sample's key (None: not known) and
    the original exception."""

    def __init__(self, index: Any, key: str | None, stage: str, cause: BaseException) -> None:
        self.index, self.key, self.stage, self.cause = index, key, stage, cause
        super().__init__(f"{sample_label(index, key)} failed in {stage}: {type(cause).__name__}: {cause}")


def sample_label(index: Any, key: str | None) -> str:
    """How errors and logs name a sample: by its key where known, always with its index; never
    an index dressed up as a key (``failed_keys`` once held ``'474'`` for sample ``'000474'``)."""
    return f"sample {key!r} (index {index})" if key is not None else f"sample at index {index}"


def key_or_index(index: Any, key: str | None) -> str:
    """A failed sample as ``stats()['failed_keys']`` lists it: its key, else ``index N``."""
    return key if key is not None else f"index {index}"


def as_index(i: Any) -> Any:
    """A sampler's index as ``dataset[...]`` gets it: numpy integers become ints; anything else (a
    list of indices for a bulk-reading dataset with ``batch_size=None``, a key) is left as it is."""
    return int(i) if isinstance(i, (int, np.integer)) else i


def _fetch_batch(
    dataset: Any,
    indices: list[int],
    cache: Any,
    on_sample: Callable[[int], None] | None,
    read_stats: Any = None,
) -> list[Any]:
    if on_sample is not None and indices:
        on_sample(indices[0])
    if cache is not None:
        from stallfree.cache.readthrough import read_through

        return list(read_through(dataset, indices, cache, stage="raw", stats=read_stats))
    get_many = contracts.batch_read_of(dataset)
    if get_many is not None:
        return list(get_many(indices))
    out = []
    for i in indices:
        if on_sample is not None:
            on_sample(i)
        out.append(dataset[i])
    return out


def fetch(
    dataset: Any,
    indices: Sequence[int],
    cache: Any = None,
    on_sample: Callable[[int], None] | None = None,
    read_stats: Any = None,
) -> list[Any]:
    """Raw samples for ``indices`` (batched read when the dataset offers ``get_many``).

    ``on_sample(i)`` is told which sample is being read (so a dead worker can be named precisely).

    A failing batched read is retried one sample at a time so one bad sample does not sink the
    batch; failed positions hold a :class:`SampleFailure`.
    """
    idx = [as_index(i) for i in indices]
    try:
        out = _fetch_batch(dataset, idx, cache, on_sample, read_stats)
        if len(out) != len(idx):
            raise RuntimeError(f"batched read returned {len(out)} samples for {len(idx)} indices")
        return out
    except Exception:  # noqa: BLE001 - fall back to per-sample reads to find the bad one(s)
        logger.debug("batched read of %d samples failed; retrying one by one", len(idx), exc_info=True)
    results: list[Any] = []
    for i in idx:
        try:
            results.append(_fetch_batch(dataset, [i], cache, on_sample, read_stats)[0])
        except Exception as exc:  # noqa: BLE001 - recorded, the policy decides
            results.append(SampleFailure(i, contracts.failed_key(dataset, i, exc), "fetch", exc))
    return results


def apply_map(samples: list[Any], indices: Sequence[int], fn: Callable[[Any], Any] | None) -> list[Any]:
    """``fn`` over each fetched sample; failures (from fetch or ``fn``) become SampleFailure."""
    out: list[Any] = []
    for s, i in zip(samples, indices, strict=False):
        if isinstance(s, SampleFailure) or fn is None:
            out.append(s)
            continue
        try:
            out.append(fn(s))
        except Exception as exc:  # noqa: BLE001 - recorded, the policy decides
            out.append(SampleFailure(as_index(i), contracts.sample_key(s), "decode", exc))
    return out


def split_failures(
    items: list[Any], indices: Sequence[int]
) -> tuple[list[Any], list[int], list[SampleFailure]]:
    """(good samples, their indices, failures) in batch order."""
    good, good_idx, bad = [], [], []
    for s, i in zip(items, indices, strict=False):
        if isinstance(s, SampleFailure):
            bad.append(s)
        else:
            good.append(s)
            good_idx.append(as_index(i))
    return good, good_idx, bad


@dataclass(frozen=True)
class DecodeOutcome:
    """A batch decoder's output over the samples it kept (``batch`` None when none was left)."""

    batch: Any
    samples: list[Any]
    indices: list[Any]
    failures: list[SampleFailure]


def decode_dropping_failures(
    decode: Callable[[list[Any]], Any], samples: list[Any], indices: list[Any], on_error: str
) -> DecodeOutcome:
    """Run a batch decoder; under on_error skip/warn drop the samples it names (a BatchDecodeError
    lists them) and decode the rest again, until it succeeds or nothing is left. Raises the
    decoder's BatchDecodeError under on_error="raise" (or when it names no sample). The one
    implementation, for decoders in the workers and in the main process alike."""
    failures: list[SampleFailure] = []
    samples, indices = list(samples), list(indices)
    while samples:
        try:
            return DecodeOutcome(decode(samples), samples, indices, failures)
        except BatchDecodeError as exc:
            if on_error == "raise" or not exc.failures:
                raise
            bad = {pos for pos, _, _ in exc.failures}
            failures += [
                SampleFailure(indices[pos], key, "decode_batch", cause) for pos, key, cause in exc.failures
            ]
            samples = [s for p, s in enumerate(samples) if p not in bad]
            indices = [i for p, i in enumerate(indices) if p not in bad]
    return DecodeOutcome(None, [], [], failures)
