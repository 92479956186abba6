"""Worker process set-up: allocator settings, start methods, liveness of the main process."""

from __future__ import annotations

import os

import pytest
import torch

from stallfree.loader import workers
from stallfree.loader.dataloader import DataLoader
from tests.loader.helpers import WorkerProbe

GLIBC = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None


@pytest.mark.skipif(not GLIBC, reason="retain_freed_memory is glibc only")
@pytest.mark.parametrize("shuffle", [True, False])  # fast mode / sampler mode
def test_workers_retain_freed_memory_but_the_main_process_does_not(shuffle):
    dl = DataLoader(WorkerProbe(12), batch_size=3, shuffle=shuffle, num_workers=2)
    assert dl.mode == ("fast" if shuffle else "sampler")
    batches = list(dl)
    assert sorted(torch.cat([b["i"] for b in batches]).tolist()) == list(range(12))
    assert all(b["retained"].tolist() == [1, 1, 1] for b in batches)
    assert {p for b in batches for p in b["pid"].tolist()} - {os.getpid()}
    assert not workers.memory_retained()  # the user's process keeps glibc's defaults
