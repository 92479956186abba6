"""What the framework integrations need to know of a ``stallfree.DataLoader``, checked in one place.

A framework counts an epoch in its own steps (transformers' ``Trainer`` resumes at
``global_step % steps_per_epoch``); our loader resumes at a global position. On the world size a
state was saved with the two agree; on another one they do not, so the integrations ask this
module where the restored loader stands in the epoch *as this world splits it* and drive the
framework from that (``EpochPosition``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stallfree.loader.dataloader import DataLoader
from stallfree.loader.epoch import order
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.epoch.timeline import Timeline


@dataclass(frozen=True)
class EpochPosition:
    """Where a restored loader stands on this rank: its epoch, the batches of that epoch this
    rank's share counts as done (``total - left``), and the batches it still yields."""

    epoch: int
    batches_done: int
    batches_left: int

    @property
    def finished(self) -> bool:
        """The saved epoch was fully consumed: the next one starts at its beginning."""
        return self.batches_left == 0


def require_own_order(loader: Any, *, who: str) -> DataLoader:
    """``loader`` if it is a ``stallfree.DataLoader`` running our order (mode ``fast``: it splits
    ranks and resumes by position); else a TypeError / ValueError saying what to change."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"{who} needs a stallfree.DataLoader, got {type(loader).__name__}")
    if loader.mode != "fast":
        raise ValueError(
            f"{who} needs the loader's own order (mode 'fast': it splits ranks and resumes by position), "
            f"but this loader runs in mode {loader.mode!r}; give it a map-style dataset, no sampler, and seed= "
            "(shuffled with shuffle=True, in index order with shuffle=False, as for evaluation)"
        )
    return loader


def check_world(loader: DataLoader, *, rank: int, size: int, who: str) -> None:
    """The loader must split the data for the framework's own rank and world size; a loader built
    before ``torch.distributed`` started believes it is alone and would give every rank all of it."""
    w = loader.world
    if (w.rank, w.size) != (rank, size):
        raise ValueError(
            f"{who}: this stallfree.DataLoader splits the data for rank {w.rank} of {w.size}, but this "
            f"process is rank {rank} of {size}; build the loader after torch.distributed is initialised "
            "(after TrainingArguments / Accelerator are created), or pass world=(rank, size)"
        )


def position_after_restore(loader: DataLoader, state: Mapping[str, Any]) -> EpochPosition:
    """Where ``loader`` stands once ``state`` is loaded into it, in this rank's batches: the share
    of the rest of the epoch this world gives the rank, cut into batches as the loader cuts it
    (``order.RankShare``, ``order.batches``), steps skipped by ``skip_steps=`` left out."""
    st = LoaderState.from_dict(state)
    if st.mode != "fast":
        raise ValueError(
            f"loader state was saved in mode {st.mode!r}; the integrations resume mode 'fast' only"
        )
    w, uneven = loader.world, loader.uneven
    batch_size = int(loader.batch_size or 1)
    # position ranges of this epoch a resume past known-bad steps leaves out (skip_steps=): the
    # resumed span starts at the state's step, past every skip the state carries
    timeline = Timeline.from_state(st.dataset_len, st.history, st.skips)
    skipped = tuple((k.lo, k.hi) for k in timeline.skips if k.epoch == st.epoch)

    def batches_from(start: int) -> int:
        share = order.RankShare(order.Sequential(st.dataset_len), start, w.rank, w.size, uneven, skipped)
        return len(order.batches(share, batch_size, loader.drop_last))

    total, left = batches_from(0), batches_from(st.consumed)
    return EpochPosition(st.epoch, total - left, left)


def at_epoch_start(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` moved back to the beginning of its epoch (same seed): for a framework told to
    start the resumed epoch over (transformers' ``ignore_data_skip``)."""
    st = LoaderState.from_dict(state)
    return {**st.to_dict(), "consumed": 0, "batches": 0}
