"""``load_state_dict(state, skip_steps=[(a, b)])``: every rank leaves out the same global batches
(those steps ``a..b-1`` of the saved run held), the rest of the order is unchanged, and the
skips travel in the state so ``samples_at`` and later resumes know them."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from stallfree.loader.dataloader import DataLoader


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 101

    def __getitem__(self, i: int) -> int:
        return i


def _loader(rank: int, world: int, **kw) -> DataLoader:
    return DataLoader(Numbers(), batch_size=4, shuffle=True, seed=7, world=(rank, world), **kw)


def _run(world: int, state=None, skip=(), batches=None, workers=0, epochs=1) -> tuple[dict, dict]:
    """Each rank's batches by step (``batches`` at most, over up to ``epochs`` epochs), and the
    last rank's state."""
    got = {}
    for rank in range(world):
        dl = _loader(rank, world, num_workers=workers)
        if state is not None:
            dl.load_state_dict(state, skip_steps=skip)
        step = 0 if state is None else state["step"]
        stream = itertools.chain.from_iterable(iter(dl) for _ in range(epochs))
        for batch in itertools.islice(stream, batches):
            got[(rank, step)] = batch.tolist()
            step += 1
        last = dl.state_dict()
    return got, last


def test_same_world_resume_skips_exactly_those_global_batches():
    whole, _ = _run(3)  # the uninterrupted epoch: steps 0..8
    head, state = _run(3, batches=2)
    rest, after = _run(3, state=state, skip=[(4, 6)], workers=1)
    assert head == {k: v for k, v in whole.items() if k[1] < 2}
    # step 2, 3 as before; the resumed run's step 4 is the batch that was step 6
    for rank in range(3):
        resumed = [rest[(rank, s)] for s in sorted(s for r, s in rest if r == rank)]
        original = [whole[(rank, s)] for s in range(2, 9) if s not in (4, 5)]
        assert resumed == original
    assert [(k["steps"], k["epoch"]) for k in after["skips"]] == [([4, 6], 0)]
    assert after["epoch"] == 1 and after["consumed"] == 0


def test_a_skip_resumed_on_another_world_size_leaves_out_the_same_samples():
    whole, _ = _run(3)
    head, state = _run(3, batches=2)
    skipped = {i for (r, s), b in whole.items() if s in (4, 5, 6) for i in b}
    rest, after = _run(2, state=state, skip=[(4, 7)])
    seen = Counter(i for part in (head, rest) for b in part.values() for i in b)
    assert set(seen) == set(range(101)) - skipped  # nothing else lost
    assert sorted(seen.values())[-2:] == [1, 2]  # one repeat: the padding that evens out 2 ranks
    assert after["history"][-1]["world_size"] == 2
    resumed_loader = _loader(0, 2)
    resumed_loader.load_state_dict(after)
    for (rank, step), batch in rest.items():  # the trace knows the skip and the new world size
        assert resumed_loader.samples_at(step, rank).indices == batch


def test_a_skip_across_the_epoch_boundary_and_a_later_resume_keeps_it():
    whole, _ = _run(2, batches=None)
    per_epoch = len(_loader(0, 2))  # 13 steps of 2 x 4 (101 padded to 104)
    head, state = _run(2, batches=11)
    rest, after = _run(2, state=state, skip=[(12, 15)], batches=3, epochs=2)  # 12: epoch 0's last
    e1 = {}
    for rank in range(2):
        dl = _loader(rank, 2)
        dl.set_epoch(1)
        for b, batch in enumerate(dl):
            e1[(rank, per_epoch + b)] = batch.tolist()
    assert rest[(0, 11)] == whole[(0, 11)]  # step 11: epoch 0's last but one
    assert rest[(0, 12)] == e1[(0, 15)]  # epoch 0's last step and epoch 1's first two left out
    assert {k["epoch"] for k in after["skips"]} == {0, 1}
    assert rest[(1, 13)] == e1[(1, 16)]
    later, _ = _run(2, state=after, batches=2)  # a resume of the resumed run: the skips stay
    assert later[(1, after["step"])] == e1[(1, 17)]


def test_skipping_steps_already_trained_on_is_refused():
    _, state = _run(1, batches=5)
    with pytest.raises(ValueError, match="resumes at step 5"):
        _loader(0, 1).load_state_dict(state, skip_steps=[(3, 6)])
    with pytest.raises(ValueError, match="first < end"):
        _loader(0, 1).load_state_dict(state, skip_steps=[(7, 7)])
    with pytest.raises(ValueError, match="pairs"):
        _loader(0, 1).load_state_dict(state, skip_steps=[5])
