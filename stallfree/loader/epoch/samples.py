"""The samples of any training step, computed from the order and the run's timeline (no log):
``DataLoader.samples_at`` and ``stallfree trace`` share ``step_samples``; ``trace_state`` does
it from a saved resume state and the dataset alone (the order rebuilt from the state's seed and
order identity)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stallfree.loader.epoch import order as order_mod
from stallfree.loader.epoch.refs import SampleRef, describe
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.epoch.timeline import Timeline


@dataclass(frozen=True)
class StepSamples:
    """Step ``step``'s batch on rank ``rank`` of ``world_size``: batch ``batch`` of that rank's
    share of epoch ``epoch``; ``samples`` in batch order. ``skips``: the skipped steps the
    timeline knew of (``(first, end)`` of the run that skipped them)."""

    step: int
    epoch: int
    rank: int
    world_size: int
    batch: int
    samples: tuple[SampleRef, ...]
    skips: tuple[tuple[int, int], ...] = ()

    @property
    def indices(self) -> list[int]:
        return [s.index for s in self.samples]

    @property
    def positions(self) -> list[int]:
        return [s.position for s in self.samples]

    @property
    def keys(self) -> list[str | None]:
        return [s.key for s in self.samples]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch": self.batch,
            "skips": [list(k) for k in self.skips],
            "samples": [s.to_dict() for s in self.samples],
        }


def step_samples(
    dataset: Any,
    order_of: Callable[[int], order_mod.Order],
    timeline: Timeline,
    step: int,
    rank: int,
    *,
    keys: bool = True,
) -> StepSamples:
    """The batch of ``step`` on ``rank`` (see the module docstring); ``keys=False``: no sample
    keys (refs.describe)."""
    place = timeline.place(step)
    world = place.span.world_size
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} outside the world of {world} ranks that read step {step}")
    order = order_of(place.epoch)
    share = place.share(order, int(rank))
    bs = place.span.batch_size
    k = np.arange(place.batch * bs, min((place.batch + 1) * bs, len(share)), dtype=np.int64)
    positions = share.positions(k)
    padded = share.padded(k)
    indices = order.at(positions)
    fields = describe(dataset, indices.tolist(), place.epoch, keys=keys)
    samples = tuple(
        SampleRef(position=int(p), index=int(i), padded=bool(pad), **f)
        for p, i, pad, f in zip(positions.tolist(), indices.tolist(), padded.tolist(), fields, strict=True)
    )
    skips = tuple(sorted({k.steps for k in timeline.skips}))
    return StepSamples(int(step), place.epoch, int(rank), world, place.batch, samples, skips)


def order_from_state(state: LoaderState, dataset: Any) -> Callable[[int], order_mod.Order]:
    """The epoch order a state was saved under, rebuilt from its seed and order identity
    (``order.order_identity``: name, revision, window, short first window)."""
    if state.order is None:
        raise ValueError("the state has no order: it was saved by torch's sampler or a stream, not our order")
    name, *rest = state.order.split("/")
    window, first = 8, None
    for part in rest:
        if part.startswith("window="):
            window = int(part.split("=", 1)[1])
        elif part.startswith("first="):
            first = int(part.split("=", 1)[1])
    if order_mod.order_identity(name, window, first) != state.order:
        raise ValueError(
            f"the state's order {state.order!r} is not one this build lays out the same way "
            f"({order_mod.order_identity(name, window, first)!r}): its positions would name other samples"
        )
    n = len(dataset)
    sizes = _sizes_of(dataset)

    def order_of(epoch: int) -> order_mod.Order:
        return order_mod.make_order(
            state.seed, epoch, n, mode=name, shard_sizes=sizes, window=window, first_window=first
        )

    return order_of


def trace_state(
    state: Mapping[str, Any], dataset: Any, step: int, rank: int = 0, *, keys: bool = True
) -> StepSamples:
    """The batch of ``step`` on ``rank``, from a saved resume state (``loader.state_dict()``)
    and the dataset it was saved for; a step past the state's, as its run would read on."""
    st = LoaderState.from_dict(state)
    if not st.history:
        raise ValueError(
            "the state has no timeline ('history'): it was saved by a stallfree before steps were "
            "recorded, or by torch's sampler or a stream"
        )
    n = len(dataset)
    if st.dataset_len and st.dataset_len != n:
        raise ValueError(f"the state is for a dataset of {st.dataset_len} samples, this one has {n}")
    check = getattr(dataset, "check_state", None)
    if st.dataset is not None and check is not None:
        check(st.dataset)
    fp = getattr(dataset, "fingerprint", None)
    if st.fingerprint is not None and isinstance(fp, str) and fp != st.fingerprint:
        raise ValueError(
            f"the state is for a dataset with fingerprint {st.fingerprint!r}, this one's is {fp!r}"
        )
    timeline = Timeline.from_state(n, st.history, st.skips)
    return step_samples(dataset, order_from_state(st, dataset), timeline, step, rank, keys=keys)


_SIZES: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _sizes_of(dataset: Any) -> tuple[int, ...] | None:
    """The dataset's shard sizes as the tuple an order request holds, kept per dataset: 200,000
    of them take longer to copy than the rest of a lookup."""
    sizes = getattr(dataset, "shard_sizes", None)
    if sizes is None:
        return None
    try:
        got = _SIZES.get(dataset)
    except TypeError:
        got = None
    if got is None or len(got) != len(sizes):
        got = tuple(sizes)
        try:
            _SIZES[dataset] = got
        except TypeError:
            pass
    return got
