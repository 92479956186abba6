"""Child side of test_torch_equivalence.py: the datasets, samplers and scenarios, run in a fresh
interpreter per loader (``python -c _CHILD scenario impl``) that prints its observations as JSON.

Kept apart from the test module so that each child, and each spawn or forkserver worker that
unpickles a dataset, imports only torch and stallfree, not pytest: 0.25 CPU-s a process, about 40
processes a run. The children fork from a zygote that imported torch and stallfree once
(``tests/zygote.py``).
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import os
import tempfile
import time
import warnings
from pathlib import Path

import psutil
import torch
import torch.utils.data as tud

import stallfree

MARK = "RESULT:"

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
    print(MARK + json.dumps(result), flush=True)


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
    return {
        "values": out["values"],
        "errors": len(out["errors"]),
        "types": sorted({t for t, _ in out["errors"]}),
    }


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
