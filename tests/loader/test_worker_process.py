"""Worker processes: shared-slot memory, start methods, liveness of the main process."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from stallfree.loader.dataloader import DataLoader
from stallfree.loader.errors import WorkerDiedError
from tests.loader.helpers import (
    FinaliserProbe,
    LiveSamples,
    Numbers,
    WorkerProbe,
    collect_garbage,
    rss_shmem,
    segfault_on_3,
)
from tests.zygote import run_python

LINUX = sys.platform.startswith("linux")


@pytest.mark.skipif(not LINUX, reason="reads RssShmem from /proc")
@pytest.mark.parametrize("shuffle", [True, False])  # fast mode / sampler mode
def test_slots_leave_each_process_resident_set_once_done(shuffle):
    """A worker lets go of its mapping of a slot once it has sent the batch, and the main process
    once the consumer has dropped it: neither keeps every slot it touched resident."""
    batch_bytes = 3 * (4 << 20)
    dl = DataLoader(
        WorkerProbe(24, nbytes=4 << 20), batch_size=3, shuffle=shuffle, num_workers=2, persistent_workers=True
    )
    assert dl.mode == ("fast" if shuffle else "sampler")
    seen, peak_main = [], 0
    base = rss_shmem()
    for b in dl:
        per_sample = b["x"].sum(dim=1)  # the step reads every byte of the batch
        assert per_sample.tolist() == [float(i) * (1 << 20) for i in b["i"].tolist()]
        peak_main = max(peak_main, rss_shmem() - base)
        seen.append(b)
        if len(seen) > 1:
            seen.pop(0)  # the consumer keeps at most two batches
    assert peak_main < 3 * batch_bytes  # the two held batches, not all 2 workers x 3 slots
    del seen, b
    gc.collect()
    assert rss_shmem() - base < batch_bytes // 2  # nothing held: nothing mapped, slots still alive
    dl.close()
    dl2 = DataLoader(WorkerProbe(24, nbytes=4 << 20), batch_size=3, shuffle=shuffle, num_workers=2)
    batches = list(dl2)
    assert sorted(torch.cat([b["i"] for b in batches]).tolist()) == list(range(24))
    assert {p for b in batches for p in b["pid"].tolist()} - {os.getpid()}
    # a worker starts each sample with no slot mapped: every batch it filled went out and was let go
    # collate writes the slot through its shm file (shm.SlotFile), so not even the batch being
    # collated while the fetch thread reads ahead is mapped
    assert max(b["shm_mapped"].max().item() for b in batches) < batch_bytes // 8


@pytest.mark.parametrize("shuffle", [True, False])  # fast mode / sampler mode
def test_forkserver_workers_stay_alive_while_idle(shuffle):
    """Under a fork server a worker's parent is the server, not the loader's process: the workers
    must still see the loader's process as alive through idle spells (their check runs after 1 s
    without a task), so persistent workers serve a second epoch after a pause."""
    dl = DataLoader(
        WorkerProbe(10),
        batch_size=4,
        shuffle=shuffle,
        num_workers=2,
        multiprocessing_context="spawn",
        persistent_workers=True,
        seed=0 if shuffle else None,
    )
    first = list(dl)
    time.sleep(2.5)  # idle: every worker runs its liveness check at least once
    second = list(dl)
    for batches in (first, second):
        assert sorted(torch.cat([b["i"] for b in batches]).tolist()) == list(range(10))
    pids = {p for b in first + second for p in b["pid"].tolist()}
    assert len(pids) == 2 and os.getpid() not in pids  # the same two persistent workers served both
    dl.close()


_ORPHAN = """
import os, signal, sys
sys.path.insert(0, {root!r})
from stallfree.loader.dataloader import DataLoader
from tests.loader.helpers import WorkerProbe
if __name__ == "__main__":
    dl = DataLoader(WorkerProbe(8), batch_size=2, shuffle=True, seed=0, num_workers=2,
                    multiprocessing_context={ctx!r}, persistent_workers=True)
    pids = sorted({{p for b in dl for p in b["pid"].tolist()}})
    print(" ".join(map(str, pids)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up: the workers must notice by themselves
"""


@pytest.mark.slow
@pytest.mark.parametrize("ctx", ["forkserver", "fork", "spawn"])
def test_workers_exit_when_the_main_process_is_killed(ctx):
    script = _ORPHAN.format(root=str(Path(__file__).resolve().parents[2]), ctx=ctx)
    proc = run_python(script, timeout=120)  # torch preloaded (tests/zygote.py); its workers start by ctx
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 60  # generous: only a hang fails this

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)]


def test_a_worker_crashing_in_native_code_leaves_its_python_stack(capfd):
    """A spawned worker has no fault handler of pytest's: the loader turns one on, so a
    segfault in a decoder prints where it happened, and the loader names the worker and sample."""
    dl = DataLoader(
        Numbers(8),
        batch_size=4,
        shuffle=False,
        seed=0,
        num_workers=1,
        decode=segfault_on_3,
        multiprocessing_context="spawn",
        decode_threads=1,
    )
    with pytest.raises(WorkerDiedError, match=r"exit code -11, while loading sample 3"):
        list(dl)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err and "in segfault_on_3" in err


def test_a_forked_worker_never_runs_finalisers_of_the_parents_garbage():
    """Garbage in a reference cycle when the workers fork (a DALI pipeline, in the case that
    crashed) is collected in the parent, never in a worker, where its threads do not exist."""
    read_fd, write_fd = os.pipe()
    gc.disable()  # keep the cycle uncollected until the workers have forked
    try:
        FinaliserProbe(write_fd)
        dl = DataLoader(
            Numbers(8), batch_size=2, shuffle=True, seed=0, num_workers=2, worker_init_fn=collect_garbage
        )
        it = iter(dl)
        gc.enable()
        batches = list(it)
    finally:
        gc.enable()
    assert sorted(torch.cat([b["i"] for b in batches]).tolist()) == list(range(8))
    gc.collect()  # the parent frees it now
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        pids = [int(line) for line in f.read().split()]
    assert pids == [os.getpid()]


@pytest.mark.parametrize("shuffle", [True, False])  # fast mode / sampler mode
def test_a_plain_dataset_is_read_inline_one_sample_alive_at_a_time(shuffle):
    """torch's Dataset as is (decode in __getitem__): the worker reads sample by sample and each
    goes into its batch row at once, so no batch of decoded samples is held (a fetch thread would
    hold whole batches ahead)."""
    dl = DataLoader(LiveSamples(48, width=1024), batch_size=8, shuffle=shuffle, num_workers=2)
    batches = list(dl)
    assert sorted(torch.cat([b["i"] for b in batches]).tolist()) == list(range(48))
    assert all(torch.equal(b["x"][:, 0], b["i"].float()) for b in batches)
    assert max(b["alive"].max().item() for b in batches) <= 1


class _SigtermHandler(torch.utils.data.Dataset):
    """Each sample says what a worker does on SIGTERM (0: the default, i.e. it ends)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return 0 if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else 1


def test_workers_do_not_inherit_the_training_process_sigterm_handler():
    """Lightning installs a SIGTERM handler that only logs; forked workers must still end on SIGTERM."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        batches = list(
            DataLoader(_SigtermHandler(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [b.tolist() for b in batches] == [[0, 0], [0, 0]]
