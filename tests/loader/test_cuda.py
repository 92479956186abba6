"""Device path: pinned batches and the side-stream copy to ``device=`` (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from stallfree.loader.dataloader import DataLoader
from tests.loader.helpers import Big, Numbers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_arrive_on_the_device_with_exact_values(num_workers):
    dl = DataLoader(
        Numbers(40, width=8),
        batch_size=4,
        shuffle=True,
        seed=0,
        num_workers=num_workers,
        pin_memory=True,
        device="cuda",
    )
    seen = []
    for b in dl:
        assert b["x"].is_cuda and b["i"].is_cuda
        assert torch.equal(b["x"][:, 0], b["i"].float())
        seen += b["i"].tolist()
    assert sorted(seen) == list(range(40))


def test_pinned_batches_without_device():
    b = next(iter(DataLoader(Numbers(8), batch_size=4, shuffle=True, seed=0, num_workers=2, pin_memory=True)))
    assert b["x"].is_pinned()


def test_device_batches_stay_valid_while_the_next_ones_are_copied():
    dl = DataLoader(
        Big(32, 1 << 20), batch_size=4, shuffle=True, seed=0, num_workers=2, pin_memory=True, device="cuda"
    )
    for b in dl:
        torch.cuda._sleep(1_000_000)  # a slow kernel on the consumer's stream while copies go on
        assert torch.equal(b["x"][:, 0].cpu(), b["i"].float().cpu())
