"""Attributes torch lets a user reassign after construction take effect here too (the plan is
made again), without changing the epoch order or losing restored resume state."""

from __future__ import annotations

import pytest

from stallfree import DataLoader
from tests.loader.helpers import Numbers


def tagged(samples: list[dict]) -> tuple[str, list[int]]:
    return ("tagged", [s["i"] for s in samples])


@pytest.mark.parametrize("workers", [0, 2])
def test_reassigned_collate_fn_is_used_and_the_order_is_unchanged(workers):
    control = DataLoader(Numbers(10), batch_size=4, shuffle=True, seed=3, num_workers=workers)
    dl = DataLoader(Numbers(10), batch_size=4, shuffle=True, seed=3, num_workers=workers)
    first = [b["i"].tolist() for b in dl]
    assert first == [b["i"].tolist() for b in control]
    dl.collate_fn = tagged
    second = list(dl)
    assert second == [("tagged", b["i"].tolist()) for b in control]  # epoch 1 of the same seed
    assert sorted(i for _, ids in second for i in ids) == list(range(10))


def test_reassigning_keeps_restored_resume_state():
    dl = DataLoader(Numbers(12), batch_size=4, shuffle=True, seed=5)
    it = iter(dl)
    taken = next(it)["i"].tolist()
    state = dl.state_dict()
    del it
    resumed = DataLoader(Numbers(12), batch_size=4, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    resumed.collate_fn = tagged
    rest = [i for _, ids in resumed for i in ids]
    assert sorted(taken + rest) == list(range(12))


def test_reassigned_worker_init_fn_runs_in_each_worker(tmp_path):
    dl = DataLoader(Numbers(8), batch_size=4, num_workers=2, seed=0)
    dl.worker_init_fn = _touch_marker
    _touch_marker.folder = str(tmp_path)  # fork: the workers see it
    assert sorted(i for b in dl for i in b["i"].tolist()) == list(range(8))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]


def _touch_marker(worker_id: int) -> None:
    with open(f"{_touch_marker.folder}/worker-{worker_id}", "w"):
        pass
