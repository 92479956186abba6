"""Sampler mode (map-style dataset with a sampler, batch sampler or no shuffle): torch's order,
our workers — so errors name samples, hangs become errors, and resume skips indices, not data."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.utils.data as tud

from stallfree.loader.dataloader import DataLoader
from stallfree.loader.errors import WorkerHungError
from tests.loader.helpers import Failing, Hangs, Numbers, indices


class Counted(Numbers):
    """Counts reads (in-process use only)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.reads: list[int] = []

    def __getitem__(self, i: int) -> dict:
        self.reads.append(i)
        return super().__getitem__(i)


def test_modes():
    assert DataLoader(Numbers(4)).mode == "sampler"
    assert DataLoader(Numbers(4), shuffle=True).mode == "fast"
    assert DataLoader(Numbers(4), sampler=tud.SequentialSampler(range(4))).mode == "sampler"
    assert DataLoader(Stream()).mode == "iterable"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_order_and_batches_equal_torch(num_workers):
    sampler = [5, 3, 9, 0, 1, 2]
    ours = [
        b["i"].tolist()
        for b in DataLoader(Numbers(10), batch_size=4, sampler=sampler, num_workers=num_workers)
    ]
    theirs = [b["i"].tolist() for b in tud.DataLoader(Numbers(10), batch_size=4, sampler=sampler)]
    assert ours == theirs == [[5, 3, 9, 0], [1, 2]]


def test_error_names_the_sample_in_sampler_mode():
    with pytest.raises(ValueError, match=r"worker process \d while loading sample at index 6"):
        list(DataLoader(Failing(10, {6}), batch_size=2, num_workers=2))


def test_hung_worker_in_sampler_mode_is_an_error_not_a_hang():
    dl = DataLoader(Hangs(8, at=3), batch_size=2, num_workers=2, worker_timeout=1.0)
    with pytest.raises(WorkerHungError, match="sample 3"):
        list(dl)


def test_resume_skips_indices_without_reading_them():
    ds = Counted(20)
    dl = DataLoader(ds, batch_size=3)
    it = iter(dl)
    first = next(it)["i"].tolist() + next(it)["i"].tolist()
    state = json.loads(json.dumps(dl.state_dict()))
    del it
    assert state["mode"] == "sampler" and state["batches"] == 2
    ds2 = Counted(20)
    dl2 = DataLoader(ds2, batch_size=3)
    dl2.load_state_dict(state)
    rest = indices(dl2)
    assert first + rest == list(range(20))
    assert sorted(ds2.reads) == list(range(6, 20))  # the skipped batches were never read


def test_batch_size_none_through_our_workers():
    got = list(DataLoader(Numbers(5), batch_size=None, num_workers=2))
    assert [b["i"] for b in got] == list(range(5))
    assert all(isinstance(b["x"], torch.Tensor) and b["x"].shape == (4,) for b in got)


def test_skip_policy_in_sampler_mode_and_stats():
    dl = DataLoader(Failing(12, {4}), batch_size=4, num_workers=2, on_error="skip")
    got = indices(dl)
    assert got == [i for i in range(12) if i != 4]
    st = dl.stats()
    assert st["path"] == "sampler" and st["failures"] == 1 and st["batches"] == 3


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_iterable_mode_resume_replays_to_the_same_place():
    dl = DataLoader(Stream(), batch_size=3)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    dl2 = DataLoader(Stream(), batch_size=3)
    dl2.load_state_dict(state)
    assert [b.tolist() for b in dl2] == [[3, 4, 5], [6, 7, 8], [9]]


def test_state_from_another_mode_is_refused():
    st = DataLoader(Numbers(4), shuffle=True, seed=0).state_dict()
    with pytest.raises(ValueError, match="fast path but this loader uses the sampler path"):
        DataLoader(Numbers(4)).load_state_dict(st)


class HangingStream(tud.IterableDataset):
    def __iter__(self):
        yield 1
        time.sleep(60)
        yield 2


def test_iterable_mode_hung_worker_times_out_instead_of_hanging():
    dl = DataLoader(HangingStream(), batch_size=None, num_workers=1, worker_timeout=1.0)
    with pytest.raises(RuntimeError, match="timed out after 1.0 seconds"):
        list(dl)


@pytest.mark.parametrize(
    "n, world, bs, uneven, drop_last",
    [(61, 3, 4, "pad", False), (61, 3, 4, "drop", True), (10, 4, 3, "pad", True), (7, 1, 7, "pad", False)],
)
def test_fast_len_matches_the_plan(n, world, bs, uneven, drop_last):
    for r in range(world):
        dl = DataLoader(
            Numbers(n),
            batch_size=bs,
            shuffle=True,
            seed=0,
            world=(r, world),
            uneven=uneven,
            drop_last=drop_last,
        )
        assert len(dl) == len(list(dl))


def _bad_init(worker_id: int) -> None:
    raise RuntimeError(f"init failed in {worker_id}")


@pytest.mark.parametrize("shuffle", [False, True])
def test_worker_init_fn_error_is_reraised_naming_the_worker(shuffle):
    dl = DataLoader(Numbers(8), batch_size=2, shuffle=shuffle, num_workers=2, worker_init_fn=_bad_init)
    with pytest.raises(RuntimeError, match=r"init failed in \d") as err:
        list(dl)
    assert "DataLoader worker process" in str(err.value)
