"""Epoch order as a pure function of (seed, epoch, dataset length), and each rank's slice of it.

The global order never depends on the world size: rank ``r`` of ``W`` takes positions
``r, r+W, r+2W, ...`` of what is left of the epoch. After every rank has received ``k`` samples
(ranks run in lockstep), exactly the first ``k*W`` remaining positions are consumed, so a job can
stop anywhere and resume on any number of ranks with nothing lost or repeated.

Uneven tails follow ``DistributedSampler``: ``"pad"`` repeats the epoch's first positions (cycled
when the epoch is shorter than the padding) so all ranks get the same count (a few samples are
seen twice in that epoch) — the epoch's, not the resume point's, so a resume on the same world
size receives exactly the padding an uninterrupted run would, ``"drop"`` leaves out the
last ``len % W`` positions (a few samples are skipped in that epoch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ORDERS = ("global", "block", "sequential")
UNEVEN = ("pad", "drop")


def _rng(seed: int, epoch: int, salt: int = 0) -> np.random.Generator:
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([int(seed) & (2**63 - 1), int(epoch), salt]))
    )


def global_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """A full permutation of ``range(n)``; random access datasets read in this order."""
    return _rng(seed, epoch).permutation(n).astype(np.int64)


def block_order(seed: int, epoch: int, shard_sizes: Sequence[int], window: int = 8) -> np.ndarray:
    """Shuffle shards, then shuffle samples inside each run of ``window`` consecutive shards.

    Readers of a remote object store then touch only ``window`` shards at a time (long ranged
    reads, a warm cache) while the order stays random enough for SGD.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else np.zeros(0, np.int64)
    rng = _rng(seed, epoch, salt=1)
    shard_perm = rng.permutation(len(sizes))
    parts = []
    for w in range(0, len(shard_perm), window):
        group = shard_perm[w : w + window]
        idx = np.concatenate([np.arange(starts[s], starts[s] + sizes[s]) for s in group])
        parts.append(rng.permutation(idx))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def epoch_order(
    seed: int,
    epoch: int,
    n: int,
    *,
    mode: str = "global",
    shard_sizes: Sequence[int] | None = None,
    window: int = 8,
) -> np.ndarray:
    """The epoch's global order of sample indices (``mode`` is global, block or sequential)."""
    if mode == "sequential":
        return np.arange(n, dtype=np.int64)
    if mode == "global":
        return global_order(seed, epoch, n)
    if mode == "block":
        if shard_sizes is None:
            raise ValueError("block order needs the dataset's shard_sizes")
        if sum(shard_sizes) != n:
            raise ValueError(f"shard_sizes sum to {sum(shard_sizes)} but the dataset has {n} samples")
        return block_order(seed, epoch, shard_sizes, window)
    raise ValueError(f"order must be one of {ORDERS}, got {mode!r}")


def remaining_for_world(order: np.ndarray, start: int, world_size: int, uneven: str = "pad") -> np.ndarray:
    """Positions ``start:`` of ``order``, padded (from the epoch's start) or cut so ``world_size``
    ranks get equal counts."""
    if uneven not in UNEVEN:
        raise ValueError(f"uneven must be one of {UNEVEN}, got {uneven!r}")
    rest = order[min(max(start, 0), len(order)) :]
    extra = len(rest) % world_size
    if extra == 0 or len(rest) == 0:
        return rest
    if uneven == "drop":
        return rest[: len(rest) - extra]
    # Pad from the epoch's first positions, not the resume point's: the padded sequence is then
    # one fixed function of (order, world_size), and a resume continues it exactly.
    return np.concatenate([rest, np.resize(order, world_size - extra)])


def rank_share(order: np.ndarray, start: int, rank: int, world_size: int, uneven: str = "pad") -> np.ndarray:
    """The sample indices rank ``rank`` reads this epoch, continuing from global position ``start``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    return remaining_for_world(order, start, world_size, uneven)[rank::world_size]


def consumed_after(start: int, received_on_rank: int, world_size: int, n: int) -> int:
    """Global position reached once every rank has received ``received_on_rank`` samples."""
    return min(start + received_on_rank * world_size, n)


def batches(share: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """Cut a rank's share into batches (the last one short unless ``drop_last``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = [share[i : i + batch_size] for i in range(0, len(share), batch_size)]
    if drop_last and out and len(out[-1]) < batch_size:
        out.pop()
    return out
