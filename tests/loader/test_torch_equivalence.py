"""Drop-in fidelity: the same scenario through torch's DataLoader and ours, compared as a user sees it.

Each scenario (in ``equivalence_child.py``) runs in a fresh interpreter per loader (``_Run``), both
at once, each in a session of its own with a deadline, so a hang or a leaked worker fails the test,
not the suite: the child prints its observations as JSON, and the parent adds the exit code, the
last line of stderr, the "Exception ignored" lines and the processes of the child's session still
alive after it exited. The test then asserts that stallfree's observation equals torch's. The
scenarios follow what PyTorch's own test/test_dataloader.py checks (scripts/torch_suite.sh runs
that file against both loaders).
"""

from __future__ import annotations

import json
import os
import time
import typing
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import pytest
import torch
import torch.utils.data as tud

import stallfree
from tests.loader.equivalence_child import MARK
from tests.zygote import start_python

ROOT = Path(__file__).resolve().parents[2]
_CHILD = "import sys; from tests.loader import equivalence_child as m; m._child(sys.argv[1], sys.argv[2])"


# --- running a scenario in a child interpreter ---


@dataclass(frozen=True)
class Outcome:
    """What a user sees of one run: its exit, its output, what it left behind."""

    hung: bool
    rc: int | None
    result: typing.Any
    last_stderr_line: str
    ignored_exceptions: int
    leftover_processes: int


class _Run:
    """One child interpreter running ``scenario`` with ``impl``'s DataLoader, in a session of its own
    (forked from a zygote that imported torch and stallfree once: ``tests/zygote.py``)."""

    def __init__(self, scenario: str, impl: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.child = start_python(_CHILD, scenario, impl, cwd=ROOT, env=env)

    def finish(self, deadline: float) -> Outcome:
        """Wait until ``deadline`` (monotonic); then count what is left of the session and kill it."""
        rc = self.child.wait(timeout=max(0.0, deadline - time.monotonic()))
        _, alive = psutil.wait_procs(_session_members(self.child.pid), timeout=5)
        self.child.kill_session()
        stdout, stderr = self.child.output()
        results = [line[len(MARK) :] for line in stdout.splitlines() if line.startswith(MARK)]
        lines = [line for line in stderr.splitlines() if line.strip()]
        return Outcome(
            hung=rc is None,
            rc=rc,
            result=json.loads(results[-1]) if results else None,
            last_stderr_line=lines[-1] if lines else "",
            ignored_exceptions=sum(line.startswith("Exception ignored") for line in lines),
            leftover_processes=len(alive),
        )


def _session_members(sid: int) -> list[psutil.Process]:
    """Processes of session ``sid`` other than its leader (workers, trackers) still running."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != sid and os.getsid(p.pid) == sid:
                found.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def same_as_torch(scenario: str, timeout: float = 60) -> tuple[dict, dict]:
    """(ours, torch's) observations of ``scenario``, both run at once, as dicts for a readable diff."""
    runs = {impl: _Run(scenario, impl) for impl in ("torch", "stallfree")}
    deadline = time.monotonic() + timeout
    seen = {impl: run.finish(deadline) for impl, run in runs.items()}
    assert not seen["torch"].hung, f"torch itself hung in {scenario}"
    return asdict(seen["stallfree"]), asdict(seen["torch"])


# --- the tests ---


def test_workers_exit_when_the_iterator_is_dropped_after_one_batch():
    """test_partial_workers: three ``next(iter(DataLoader(ds, num_workers=2)))`` leave no worker."""
    ours, theirs = same_as_torch("next_iter_thrice")
    assert theirs["result"] == {"workers_alive": 0}
    assert ours == theirs


def test_workers_exit_after_break_and_del():
    ours, theirs = same_as_torch("break_then_del")
    assert theirs["result"] == {"stopped_at": 10, "workers_alive": 0}
    assert ours == theirs


def test_iterator_exposes_its_worker_processes():
    """test_get_worker_info / test_partial_workers read ``it._workers`` (one process object per worker)."""
    ours, theirs = same_as_torch("iterator_workers")
    assert theirs["result"] == {"has_workers": True, "pids_match": True}
    assert ours == theirs


@pytest.mark.parametrize("scenario", ["one_bad_sample_0", "one_bad_sample_2"])
def test_a_failing_sample_raises_for_its_batch_and_the_epoch_goes_on(scenario):
    """test_error / test_error_workers: next() raises the original error once, then continues."""
    ours, theirs = same_as_torch(scenario)
    assert theirs["result"]["values"] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert [t for t, _ in theirs["result"]["errors"]] == ["ValueError"]
    assert ours == theirs


def test_every_batch_failing_raises_once_per_batch():
    ours, theirs = same_as_torch("every_sample_bad_2")
    assert theirs["result"] == {"values": [], "errors": 21, "types": ["NotImplementedError"]}
    assert ours == theirs


@pytest.mark.parametrize("scenario", ["uncaught_large_indices", "uncaught_large_indices_persistent"])
def test_error_mid_epoch_with_the_iterator_referenced_exits(scenario):
    """test_large_sampler_indices: the process ends with the error (rc 1), nothing left running."""
    ours, theirs = same_as_torch(scenario, timeout=45)
    assert theirs["rc"] == 1 and theirs["last_stderr_line"] == "RuntimeError: My Error"
    assert ours == theirs


def test_dataloader_is_generic_like_torch():
    """test_typing: ``DataLoader[list[Tensor]]`` is an annotation torch accepts."""

    def generic(cls) -> tuple[bool, bool]:
        try:
            alias = cls[list[torch.Tensor]]
        except TypeError:
            return False, False
        return True, typing.get_origin(alias) is cls and typing.get_args(alias) == (list[torch.Tensor],)

    assert generic(tud.DataLoader) == (True, True)
    assert generic(stallfree.DataLoader) == generic(tud.DataLoader)


@pytest.mark.parametrize("scenario", ["bulk_nobatch_0", "bulk_nobatch_2"])
def test_batch_size_none_passes_a_sampler_list_to_getitem(scenario):
    """test_bulk_loading_nobatch: with batch_size=None each sampler element goes to dataset[...] whole."""
    ours, theirs = same_as_torch(scenario)
    assert theirs["result"] == [list(range(s, min(s + 4, 35))) for s in range(0, 35, 4)]
    assert ours == theirs


def test_out_of_order_hands_work_to_the_free_worker():
    """TestOutOfOrderDataLoader::test_out_of_order_index_ds: a stuck worker gets no new work."""
    ours, theirs = same_as_torch("out_of_order")
    assert theirs["result"] == {"worker_ids": [1] * 8 + [0, 0], "data": [1, 3, 4, 5, 6, 7, 8, 9, 0, 2]}
    assert ours == theirs


def test_timeout_message_matches_torch():
    ours, theirs = same_as_torch("timeout")
    assert theirs["result"] == {"raised": ["RuntimeError", "DataLoader timed out after 1 seconds"]}
    assert ours == theirs


def test_forkserver_with_unpicklable_worker_init_fn_warns_then_raises():
    """test_worker_init_fn_forkserver: torch warns "Got pickle error ..." before the error."""
    ours, theirs = same_as_torch("forkserver_unpicklable_init")
    assert theirs["result"]["raised"] is not None
    assert theirs["result"]["warnings"] == ["Got pickle error when attempting to start a worker Process"]
    assert ours == theirs


def test_batches_alive_at_interpreter_exit_print_nothing():
    """Batches (and an iterator) still referenced at exit: a clean exit, no "Exception ignored"."""
    ours, theirs = same_as_torch("batches_alive_at_exit")
    assert (theirs["rc"], theirs["ignored_exceptions"], theirs["leftover_processes"]) == (0, 0, 0)
    assert ours == theirs
