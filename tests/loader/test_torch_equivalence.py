"""Drop-in fidelity: the same scenario through torch's DataLoader and ours, compared as a user sees it.

Each scenario runs in a fresh interpreter per loader (``_Run``), both at once, each in a session of
its own with a deadline, so a hang or a leaked worker fails the test, not the suite: the child prints its
observations as JSON, and the parent adds the exit code, the last line of stderr, the "Exception
ignored" lines and the processes of the child's session still alive after it exited. The test then
asserts that stallfree's observation equals torch's. The scenarios follow what PyTorch's own
test/test_dataloader.py checks (scripts/torch_suite.sh runs that file against both loaders).
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import typing
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import pytest
import torch
import torch.utils.data as tud

import stallfree

ROOT = Path(__file__).resolve().parents[2]
_CHILD = "import sys; from tests.loader import test_torch_equivalence as m; m._child(sys.argv[1], sys.argv[2])"
_MARK = "RESULT:"


# --- datasets and samplers (module level, so spawn and forkserver workers can unpickle them) ---


class Range(tud.Dataset):
    """Sample i is i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class OneBad(Range):
    """Sample ``bad`` raises ValueError; the others are their index."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return i


class NoGetitem(tud.Dataset):
    """Every sample raises NotImplementedError (torch's base Dataset.__getitem__), as upstream's ErrorDataset."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class Empty(tud.Dataset):
    """Every sample is an empty tensor: batches of 40,960 indices cost nothing but the indices."""

    def __len__(self) -> int:
        return 10_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.empty(0)


class Bulk(Range):
    """Takes a whole list of indices per call (batch_size=None with a sampler of lists)."""

    def __getitem__(self, indices: list[int]) -> torch.Tensor:
        if not isinstance(indices, (list, tuple)):
            raise TypeError(f"expected a list of indices, got {type(indices).__name__}")
        return torch.as_tensor(indices)


class Chunks(tud.Sampler):
    """Yields range(n) in lists of ``size``."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self):
        for start in range(0, self.n, self.size):
            yield list(range(start, min(start + self.size, self.n)))

    def __len__(self) -> int:
        return math.ceil(self.n / self.size)


class WhoAmI(Range):
    """Sample i is (worker id, worker pid, i), read through torch's get_worker_info."""

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return tud.get_worker_info().id, os.getpid(), i


class FirstIsSlow(Range):
    """Sample 0 is held back until the main process has received the last sample (a flag file says so).

    With out-of-order delivery the main process sees every other sample of the free worker first, so
    the order is fixed by the loader's scheduling, not by timing; a loader that waits for sample 0
    first gets it only at the 10 s deadline, in another order.
    """

    def __init__(self, n: int, flag: str) -> None:
        super().__init__(n)
        self.flag = flag

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == 0:
            deadline = time.monotonic() + 10
            while not os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.01)
        return tud.get_worker_info().id, i


class SlowStart(Range):
    """Each worker's first sample takes 3 s."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.started = False

    def __getitem__(self, i: int) -> int:
        if not self.started:
            time.sleep(3)
            self.started = True
        return i


class Seeds(Range):
    def __getitem__(self, i: int) -> int:
        return torch.initial_seed()


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
    """One child interpreter running ``scenario`` with ``impl``'s DataLoader, in a session of its own."""

    def __init__(self, scenario: str, impl: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, scenario, impl],
            cwd=ROOT, stdout=self.out, stderr=self.err, env=env, start_new_session=True,
        )

    def finish(self, deadline: float) -> Outcome:
        """Wait until ``deadline`` (monotonic); then count what is left of the session and kill it."""
        try:
            rc: int | None = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        _, alive = psutil.wait_procs(_session_members(self.proc.pid), timeout=5)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        stdout, stderr = texts
        results = [line[len(_MARK):] for line in stdout.splitlines() if line.startswith(_MARK)]
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


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _child(scenario: str, impl: str) -> None:
    """Child side: run one scenario, print its observations; exceptions are observations too."""
    loader = tud.DataLoader if impl == "torch" else stallfree.DataLoader
    fn = SCENARIOS[scenario]
    if scenario.startswith("uncaught_"):
        result = fn(loader)  # the interpreter's own exit path is what is observed
    else:
        try:
            result = fn(loader)
        except Exception as e:  # noqa: BLE001 - the type and message are the observation
            result = {"raised": [type(e).__name__, _last_line(e)]}
    print(_MARK + json.dumps(result), flush=True)


# --- scenarios: each takes the DataLoader class and returns what a user would look at ---


def _live_children(wait: float = 5) -> int:
    """This process's children still running after ``wait`` s (helper processes not counted)."""
    kids = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmd and "forkserver" not in cmd:
            kids.append(p)
    _, alive = psutil.wait_procs(kids, timeout=wait)
    return len(alive)


def sc_next_iter_thrice(loader) -> dict:
    for _ in range(3):
        next(iter(loader(Range(64), num_workers=2)))
    gc.collect()
    return {"workers_alive": _live_children()}


def sc_break_then_del(loader) -> dict:
    dl = loader(Range(100), batch_size=2, num_workers=4)
    it = iter(dl)
    for i, _ in enumerate(it):
        if i == 10:
            break
    del it, dl
    gc.collect()
    return {"stopped_at": i, "workers_alive": _live_children()}


def sc_iterator_workers(loader) -> dict:
    it = iter(loader(WhoAmI(8), batch_size=2, num_workers=2))
    pids = sorted({int(pid) for _, batch_pids, _ in it for pid in batch_pids})
    workers = getattr(it, "_workers", None)
    return {
        "has_workers": workers is not None,
        "pids_match": workers is not None and sorted(w.pid for w in workers) == pids,
    }


def _drain(loader, dataset, **kw) -> dict:
    it = iter(loader(dataset, **kw))
    values, errors = [], []
    for _ in range(100):  # a bound, in case an error repeats forever
        try:
            values.extend(next(it).tolist())
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001 - what next() raised is the observation
            errors.append([type(e).__name__, _last_line(e)])
    return {"values": values, "errors": errors}


def sc_one_bad_sample_0(loader) -> dict:
    return _drain(loader, OneBad(10, bad=3))


def sc_one_bad_sample_2(loader) -> dict:
    return _drain(loader, OneBad(10, bad=3), num_workers=2)


def sc_every_sample_bad_2(loader) -> dict:
    out = _drain(loader, NoGetitem(41), batch_size=2, shuffle=True, num_workers=2)
    return {"values": out["values"], "errors": len(out["errors"]), "types": sorted({t for t, _ in out["errors"]})}


def _large_indices(loader, persistent: bool) -> None:
    it = iter(loader(Empty(), batch_size=40960, num_workers=1, persistent_workers=persistent))
    for x in it:
        assert x.numel() == 0
        raise RuntimeError("My Error")


def sc_uncaught_large_indices(loader) -> None:
    _large_indices(loader, persistent=False)


def sc_uncaught_large_indices_persistent(loader) -> None:
    _large_indices(loader, persistent=True)


def _bulk(loader, num_workers: int) -> list:
    dl = loader(Bulk(35), batch_size=None, sampler=Chunks(35, 4), num_workers=num_workers)
    return [t.tolist() for t in dl]


def sc_bulk_nobatch_0(loader) -> list:
    return _bulk(loader, 0)


def sc_bulk_nobatch_2(loader) -> list:
    return _bulk(loader, 2)


def sc_out_of_order(loader) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        flag = os.path.join(tmp, "main-got-the-last-sample")
        got = []
        for w, i in loader(FirstIsSlow(10, flag), num_workers=2, prefetch_factor=2, in_order=False):
            got.append((int(w), int(i)))
            if int(i) == 9:
                Path(flag).touch()
    return {"worker_ids": [w for w, _ in got], "data": [i for _, i in got]}


def sc_timeout(loader) -> dict:
    next(iter(loader(SlowStart(10), batch_size=2, num_workers=2, timeout=1)))
    return {"raised": None}


def sc_forkserver_unpicklable_init(loader) -> dict:
    multiprocessing.set_start_method("forkserver", force=True)

    def local_init(worker_id: int) -> None:  # a closure: forkserver cannot pickle it
        torch.manual_seed(12345)

    dl = loader(Seeds(4), batch_size=2, num_workers=2, worker_init_fn=local_init)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            next(iter(dl))
            raised = None
        except Exception as e:  # noqa: BLE001 - the type is the observation
            raised = type(e).__name__
    pickle_warnings = [str(w.message).split(". ")[0] for w in seen if "pickle" in str(w.message).lower()]
    return {"raised": raised, "warnings": pickle_warnings}


_KEEP: list = []


def sc_batches_alive_at_exit(loader) -> dict:
    it = iter(loader(Range(64), batch_size=4, num_workers=2))
    _KEEP.extend([next(it), next(it), it])  # still referenced when the interpreter exits
    _KEEP.extend(list(loader(Range(16), batch_size=4, num_workers=2)))
    return {"kept": len(_KEEP)}


SCENARIOS = {name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("sc_")}


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
