"""A batch the user keeps is theirs: keeping every batch behaves as with torch's DataLoader.

Before: a worker's slot pool stopped at ``Slots.HARD_CAP`` (256) slots and the worker then waited
for a slot the consumer would never give back, so ``list(loader)`` of more than 256 batches per
worker hung and ended in a misleading WorkerHungError after ``worker_timeout``. Now the batch goes
out in a segment the consumer owns (slots.py, "handover"). And a worker never outlives its main
process (lifeline.py), even while it is stuck in the dataset's code.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.utils.data as tud

from stallfree import DataLoader
from stallfree.loader.shm import slots as slots_mod
from stallfree.loader.shm.returns import SlotReturns
from tests.loader.helpers import Numbers
from tests.zygote import run_python

ROOT = Path(__file__).resolve().parents[2]
N_BATCHES = 300  # more than HARD_CAP for each worker with one worker


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("workers", [1, 2])
def test_keeping_every_batch_delivers_what_torch_delivers(workers):
    ds = Numbers(N_BATCHES * workers * 2, width=3)
    # worker_timeout bounds the old hang (it became a WorkerHungError) so this test cannot hang
    ours = list(DataLoader(ds, batch_size=2, num_workers=workers, worker_timeout=30))
    theirs = list(tud.DataLoader(ds, batch_size=2, num_workers=workers))
    assert len(ours) == N_BATCHES * workers > slots_mod.Slots.HARD_CAP * workers
    _same(ours, theirs)


def test_keeping_every_batch_on_our_order_delivers_each_sample_once():
    ds = Numbers(700, width=3)
    kept = list(DataLoader(ds, batch_size=2, shuffle=True, seed=1, num_workers=1, worker_timeout=30))
    assert sorted(i for b in kept for i in b["i"].tolist()) == list(range(700))
    assert all(torch.equal(b["x"][:, 0], b["i"].float()) for b in kept)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_kept_batches_segments_are_freed_when_the_consumer_drops_them():
    """Memory is bounded by what is kept: each handover segment (one open file each, torch's
    file-descriptor sharing) lives exactly as long as the batch that was handed over in it."""
    before = _fds()
    kept = list(DataLoader(Numbers(1200, width=3), batch_size=2, num_workers=1, worker_timeout=30))
    assert len(kept) == 600
    held = _fds() - before
    assert held >= 600 - slots_mod.Slots.HARD_CAP  # the handover segments (pool slots are mapped)
    del kept[slots_mod.Slots.HARD_CAP :]
    assert _fds() - before <= held - (600 - slots_mod.Slots.HARD_CAP)
    kept.clear()
    assert _fds() <= before + 2


def test_a_full_pool_hands_the_next_slot_over_instead_of_waiting():
    slots = slots_mod.Slots(3, SlotReturns())
    slots.HARD_CAP = 4
    pool = [slots.acquire() for _ in range(4)]
    assert not any(slots.is_handover(k) for k in pool)
    k = slots.acquire()  # every pool slot is held: no wait, a handover slot
    assert slots.is_handover(k) and slots.pooled == 4
    slots.grow(k, 1 << 16)
    slots.handed_over(k)
    assert slots.storages[k] is None and not slots.is_handover(k)
    slots.returns.send(pool[0])  # a pool slot comes back: it is reused, no handover
    again = slots.acquire()
    assert again == pool[0] and not slots.is_handover(again)
    unused = slots.acquire()
    assert slots.is_handover(unused)
    slots.unused(unused)  # a failed batch's handover slot is dropped, never pooled
    assert slots.free == [] and slots.pooled == 4


class SlowSamples(Numbers):
    """Each sample takes ``seconds``: a batch takes far longer than the worker timeout."""

    def __init__(self, n: int, seconds: float) -> None:
        super().__init__(n)
        self.seconds = seconds

    def __getitem__(self, i: int) -> dict:
        time.sleep(self.seconds)
        return super().__getitem__(i)


def test_a_worker_moving_from_sample_to_sample_is_not_hung():
    """Hung means no progress at all: a batch of 8 samples of 0.3 s each is 2.4 s of steady work,
    well over a 1.2 s worker_timeout, and must not raise WorkerHungError."""
    dl = DataLoader(SlowSamples(8, 0.3), batch_size=8, num_workers=1, worker_timeout=1.2)
    assert [i for b in dl for i in b["i"].tolist()] == list(range(8))


_ORPHAN = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from stallfree import DataLoader
from tests.loader.helpers import Hangs

if __name__ == "__main__":
    dl = DataLoader(Hangs(64, at=9, seconds=600), batch_size=4, num_workers=2, worker_timeout=None,
                    multiprocessing_context={ctx!r})
    it = iter(dl)
    for _ in range(2):
        next(it)
    pids = [p.pid for p in it._workers]
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(1.0)  # worker 0 is in its 600 s sample (index 9, batch 2)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up: the workers must go by themselves
"""


@pytest.mark.slow
@pytest.mark.parametrize("ctx", ["fork", "forkserver"])  # the kernel's tie; the watchdog's
def test_a_busy_worker_exits_when_the_main_process_is_killed(ctx):
    """A worker stuck in the dataset's code never reaches its idle check of the parent: before
    the lifeline it lived on as an orphan (parent pid 1) until its sample ended."""
    script = _ORPHAN.format(root=str(ROOT), ctx=ctx)
    proc = run_python(script, timeout=120)  # torch preloaded (tests/zygote.py); its workers start by ctx
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 30  # the watchdog looks once a second; only a hang fails this
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:  # never leave them behind for the rest of the suite
        os.kill(p, signal.SIGKILL)
    assert not left
