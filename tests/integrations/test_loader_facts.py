"""Where a restored loader stands, in this world's batches, is what it then yields: the number the
Trainer integration runs the resumed epoch on."""

from __future__ import annotations

import pytest
import torch

import stallfree
from stallfree.integrations import loader_facts


class Numbers(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(n, rank, size, batch_size, drop_last, uneven):
    return stallfree.DataLoader(
        Numbers(n), batch_size=batch_size, shuffle=True, seed=5, world=(rank, size),
        drop_last=drop_last, uneven=uneven,
    )  # fmt: skip


@pytest.mark.parametrize("uneven", ["pad", "drop"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    "n, saved_on, consumed, size",
    [(50, 2, 24, 2), (50, 2, 24, 1), (50, 1, 13, 3), (48, 2, 48, 1), (49, 3, 0, 2)],
)
def test_the_position_after_a_restore_is_what_the_loader_then_yields(
    n, saved_on, consumed, size, drop_last, uneven
):
    state = _loader(n, 0, saved_on, 4, drop_last, uneven).state_dict()
    state.update(epoch=2, consumed=consumed)
    for rank in range(size):
        loader = _loader(n, rank, size, 4, drop_last, uneven)
        loader.load_state_dict(state)
        where = loader_facts.position_after_restore(loader, state)
        loader.set_epoch(2)  # as frameworks do at the top of the resumed epoch: keeps the position
        left = list(loader)
        assert (where.epoch, where.batches_left) == (2, len(left))
        assert where.batches_done == len(loader) - len(left)
        assert where.finished == (consumed == n)


def test_a_state_moved_to_its_epoch_start_keeps_its_seed_and_epoch():
    loader = _loader(20, 0, 1, 4, False, "pad")
    state = {**loader.state_dict(), "epoch": 3, "consumed": 8, "seed": 11}
    again = _loader(20, 0, 1, 4, False, "pad")
    again.load_state_dict(loader_facts.at_epoch_start(state))
    fresh = _loader(20, 0, 1, 4, False, "pad")
    fresh.load_state_dict({**state, "consumed": 0})
    assert [b.tolist() for b in again] == [b.tolist() for b in fresh]
    assert loader_facts.position_after_restore(again, loader_facts.at_epoch_start(state)).batches_done == 0


def test_a_loader_split_for_another_world_is_refused_with_the_cause():
    loader = _loader(20, 0, 1, 4, False, "pad")
    with pytest.raises(
        ValueError, match=r"rank 0 of 1, but this process is rank 1 of 2; build the loader after"
    ):
        loader_facts.check_world(loader, rank=1, size=2, who="x")
    loader_facts.check_world(loader, rank=0, size=1, who="x")


def test_only_our_loader_in_our_order_is_accepted():
    with pytest.raises(TypeError, match="needs a stallfree.DataLoader, got DataLoader"):
        loader_facts.require_own_order(torch.utils.data.DataLoader(Numbers(4)), who="x")
    sampled = stallfree.DataLoader(Numbers(8), batch_size=2, shuffle=False)
    assert sampled.mode == "sampler"
    with pytest.raises(ValueError, match="runs in mode 'sampler'"):
        loader_facts.require_own_order(sampled, who="x")


@pytest.mark.parametrize("size", [1, 2])
def test_the_position_after_a_restore_leaves_out_skipped_steps(size):
    """A state that carries skip_steps= ranges of its epoch (saved after a resume past bad steps):
    the batches a framework is told are left are the ones the loader then yields, skips left out."""
    first = _loader(64, 0, 1, 4, False, "pad")
    it = iter(first)
    for _ in range(3):
        next(it)
    saved = first.state_dict()
    skipping = _loader(64, 0, 1, 4, False, "pad")
    skipping.load_state_dict(saved, skip_steps=[(5, 8)])  # three batches of this epoch, not yet read
    it = iter(skipping)
    next(it)
    state = skipping.state_dict()
    assert state["skips"]  # the skips travel in the state
    for rank in range(size):
        loader = _loader(64, rank, size, 4, False, "pad")
        loader.load_state_dict(state)
        where = loader_facts.position_after_restore(loader, state)
        loader.set_epoch(0)
        left = list(loader)
        assert (where.epoch, where.batches_left) == (0, len(left))
