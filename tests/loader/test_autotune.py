"""autotune: the depth tuner's decisions (pure), and the loader using it."""

from __future__ import annotations

import time

import torch.utils.data as tud

from stallfree.loader.autotune import DepthTuner
from stallfree.loader.dataloader import DataLoader
from tests.loader.helpers import Numbers


def test_tuner_grows_when_consumer_waits_and_respects_memory_budget():
    t = DepthTuner(4, min_depth=2, max_depth=64, memory_budget=10_000, window=4)
    t.saw_batch_bytes(1_000)  # budget allows 10 batches
    deltas = [t.observe(0, 0.05) for _ in range(40)]
    assert sum(deltas) == 6 and t.depth == 10
    assert [d for _, d in t.history] == [5, 6, 7, 8, 10]


def test_tuner_shrinks_when_batches_sit_unused_and_holds_when_balanced():
    t = DepthTuner(8, min_depth=2, window=4)
    for _ in range(100):
        t.observe(5, 0.0)
    assert t.depth == 2
    t2 = DepthTuner(6, min_depth=2, window=4)
    for _ in range(40):
        t2.observe(1, 0.0)  # occupancy 1, no waits: keep
    assert t2.depth == 6


class SlowNumbers(Numbers):
    def __getitem__(self, i: int) -> dict:
        time.sleep(0.01)
        return super().__getitem__(i)


def test_loader_autotune_deepens_under_stall_within_budget_and_keeps_exact_epoch():
    ds = SlowNumbers(96, width=256)  # a batch of 2 is ~2 KiB of tensors
    dl = DataLoader(
        ds, batch_size=2, shuffle=True, seed=0, num_workers=2, autotune=True, memory_budget=6 * 2100
    )
    got = [i for b in dl for i in b["i"].tolist()]
    assert sorted(got) == list(range(96))
    st = dl.stats()["autotune"]
    assert st["batch_bytes"] > 0
    assert 2 <= st["depth"] <= 6 * 2100 // st["batch_bytes"]
    assert st["history"] and st["history"][0][1] > 4  # it grew from prefetch_factor x workers = 4


def test_autotune_off_by_default():
    assert "autotune" not in DataLoader(tud.TensorDataset(), shuffle=False).stats()
