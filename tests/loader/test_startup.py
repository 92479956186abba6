"""Start-up: the pool's first batch decodes on every worker's cores (``first_batch.py``), the other
workers hold their first decode for it (bounded), and everything after runs as before."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from stallfree.loader.dataloader import DataLoader
from stallfree.loader.plan import worker_cores
from stallfree.loader.worker import first_batch_gate as first_batch
from stallfree.loader.worker.first_batch_gate import FirstBatchGate, FirstDecode, lead_threads
from tests.loader.helpers import Numbers


class ThreadsSeen:
    """A threaded batch decoder that reports, with each batch, the threads it was told to use and
    when its decode began and ended (monotonic ns: one clock for every process)."""

    runs_in_workers = True

    def __init__(self) -> None:
        self.threads = 0

    def use_threads(self, n: int) -> None:
        self.threads = n

    def decode_batch(self, samples, *, seed, alloc=None):
        began = time.monotonic_ns()
        time.sleep(0.05)  # room for the other worker to start its decode if nothing held it
        ended = time.monotonic_ns()
        return {
            "i": torch.tensor([s["i"] for s in samples]),
            "seen": torch.tensor([self.threads, began, ended, os.getpid()]),
        }


def test_the_first_batch_decodes_on_every_workers_cores_and_the_others_wait_for_it(monkeypatch):
    threads = worker_cores(2)
    lead = lead_threads(threads, 2, first_batch.available_cores())
    if lead == threads:
        pytest.skip("one core per worker pool: nothing to lend the first batch")
    monkeypatch.setattr(first_batch, "HOLD_S", 60.0)  # forked workers inherit: only the lead releases
    dl = DataLoader(Numbers(24), batch_size=4, shuffle=False, num_workers=2, decode=ThreadsSeen())
    batches = list(dl)
    assert [b["i"].tolist() for b in batches] == [list(range(k, k + 4)) for k in range(0, 24, 4)]
    seen = [b["seen"].tolist() for b in batches]
    assert [s[0] for s in seen] == [lead] + [threads] * 5  # the lead's first decode, then each share
    lead_pid = seen[0][3]
    other = next(s for s in seen if s[3] != lead_pid)  # the other worker's first decode
    assert other[1] >= seen[0][2]  # began only once the lead's had ended
    assert {s[3] for s in seen} == {lead_pid, other[3]}


def test_a_second_epoch_of_persistent_workers_is_not_held_again():
    threads = worker_cores(2)
    dl = DataLoader(
        Numbers(16),
        batch_size=4,
        shuffle=True,
        seed=3,
        num_workers=2,
        persistent_workers=True,
        decode=ThreadsSeen(),
    )
    first = [b["seen"][0].item() for b in dl]
    second = [b["seen"][0].item() for b in dl]
    assert first[1:] == [threads] * 3 and second == [threads] * 4
    assert first[0] == lead_threads(threads, 2, first_batch.available_cores())


def _fork() -> mp.context.BaseContext:
    return mp.get_context("fork")


def test_the_first_task_sent_is_the_lead_and_only_it():
    gate = FirstBatchGate(_fork())
    gate.mark_sent(2, 7)
    gate.mark_sent(2, 8)
    gate.mark_sent(3, 0)
    assert gate.is_lead(2, 7)
    assert not gate.is_lead(2, 8) and not gate.is_lead(3, 7) and not gate.is_lead(3, 0)


def test_the_lead_borrows_threads_for_its_first_decode_only_and_releases_the_others():
    gate = FirstBatchGate(_fork())
    gate.mark_sent(0, 0)
    dec = ThreadsSeen()
    lead = FirstDecode(gate, dec, threads=1, num_workers=4, cores=3)
    assert lead.lead_threads == 3 and lead.active
    with lead.around(0, 0):
        assert dec.threads == 3
    assert dec.threads == 1 and not lead.active
    assert gate.hold()  # released: a held worker goes on at once
    with lead.around(0, 2):  # later batches: untouched
        assert dec.threads == 1


def test_a_failing_first_decode_still_restores_threads_and_releases():
    gate = FirstBatchGate(_fork())
    gate.mark_sent(0, 0)
    dec = ThreadsSeen()
    lead = FirstDecode(gate, dec, threads=2, num_workers=2, cores=8)
    with pytest.raises(RuntimeError, match="decoder bug"), lead.around(0, 0):
        assert dec.threads == 4
        raise RuntimeError("decoder bug")
    assert dec.threads == 2 and gate.hold()


def test_a_lead_whose_first_task_decoded_nothing_releases_when_the_task_is_done():
    gate = FirstBatchGate(_fork())
    gate.mark_sent(0, 5)
    lead = FirstDecode(gate, ThreadsSeen(), threads=1, num_workers=2, cores=2)
    other = FirstDecode(gate, ThreadsSeen(), threads=1, num_workers=2, cores=2)
    other.task_done(0, 6)  # not the lead's task: nothing released
    assert other.active
    lead.task_done(0, 5)  # every sample failed: no decode ran
    assert not lead.active and gate.hold()


def test_a_held_worker_waits_no_longer_than_the_bound(monkeypatch):
    monkeypatch.setattr(first_batch, "HOLD_S", 0.05)
    gate = FirstBatchGate(_fork())
    gate.mark_sent(0, 0)  # a lead that never finishes (it died)
    dec = ThreadsSeen()
    other = FirstDecode(gate, dec, threads=1, num_workers=2, cores=2)
    finished = threading.Event()

    def decode_second() -> None:
        with other.around(0, 1):
            finished.set()

    t = threading.Thread(target=decode_second, daemon=True)
    t.start()
    t.join(timeout=30)
    assert finished.is_set() and not gate.hold() and dec.threads == 0  # never given the lead's threads


def test_no_gate_without_cores_to_lend_or_a_threaded_decoder():
    gate = FirstBatchGate(_fork())

    class Plain:
        def decode_batch(self, samples, *, seed):
            return samples

    assert not FirstDecode(gate, ThreadsSeen(), threads=1, num_workers=2, cores=1).active
    assert not FirstDecode(gate, ThreadsSeen(), threads=2, num_workers=2, cores=2).active
    assert not FirstDecode(gate, Plain(), threads=1, num_workers=2, cores=8).active
    assert not FirstDecode(None, ThreadsSeen(), threads=1, num_workers=2, cores=8).active
    assert lead_threads(1, 8, 4) == 4 and lead_threads(4, 2, 16) == 8 and lead_threads(2, 1, 8) == 2


def test_the_parent_death_signal_is_set_without_looking_for_libc():
    """``prctl`` from the process's own symbols (``find_library`` ran ``ldconfig`` in every worker):
    the kernel reports the signal back."""
    if not sys.platform.startswith("linux"):
        pytest.skip("prctl is Linux's")
    code = (
        "import ctypes, signal\n"
        "from stallfree.loader.worker import lifeline\n"
        "assert lifeline._set_pdeathsig(signal.SIGUSR1)\n"
        "got = ctypes.c_int(0)\n"
        "assert ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0) == 0\n"  # PR_GET_PDEATHSIG
        "print(got.value)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(int(signal.SIGUSR1))
