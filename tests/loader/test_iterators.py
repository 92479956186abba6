"""Several iterators of one loader, as torch's DataLoader has them.

Before: ``a = iter(dl); next(a); b = iter(dl)`` ended ``a`` silently: 90 of its 100 samples were
never delivered (torch's ``a`` carries on). Now every ``iter()`` is independent (its own epoch
and workers), except with ``persistent_workers=True``, where torch resets its one iterator: the
older iterator then raises ``IteratorSupersededError`` instead of stopping as if its epoch ended.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.utils.data as tud

from stallfree import DataLoader, mix
from stallfree.loader.errors import IteratorSupersededError
from tests.loader.helpers import Numbers

ROOT = Path(__file__).resolve().parents[2]
N, BS = 100, 10


class Stream(tud.IterableDataset):
    """0..n-1, split between torch's workers (the dataset decides what each worker yields)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"i": i, "x": torch.zeros(2)}


def _loader(mode: str, workers: int, persistent: bool = False) -> DataLoader:
    kw = {"num_workers": workers, "persistent_workers": persistent, "batch_size": BS}
    if mode == "fast":
        return DataLoader(Numbers(N), shuffle=True, seed=3, **kw)
    if mode == "sampler":
        return DataLoader(Numbers(N), **kw)
    return DataLoader(Stream(N), **kw)


def _ids(batches) -> list[int]:
    return sorted(i for b in batches for i in b["i"].tolist())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["fast", "sampler", "iterable"])
def test_a_second_iter_leaves_the_first_iterator_its_whole_epoch(mode, workers):
    dl = _loader(mode, workers)
    try:
        assert dl.mode == mode
        a = iter(dl)
        first = next(a)
        b = iter(dl)
        b_first = next(b)
        rest_of_a = list(a)  # the rest of a's epoch, all of it
        assert _ids([first, *rest_of_a]) == list(range(N))
        assert _ids([b_first, *b]) == list(range(N))  # b: an epoch of its own
        with pytest.raises(StopIteration):
            next(a)
    finally:
        dl.close()


@pytest.mark.parametrize("mode", ["fast", "sampler", "iterable"])
def test_with_persistent_workers_the_older_iterator_says_it_was_superseded(mode):
    dl = _loader(mode, 2, persistent=True)
    try:
        a = iter(dl)
        next(a)
        b = iter(dl)
        with pytest.raises(
            IteratorSupersededError,
            match=r"ended by a later iter\(\).* after 1( of 10)? batch\(es\) of epoch 0",
        ):
            next(a)
        with pytest.raises(StopIteration):  # said once; then it is simply over
            next(a)
        assert _ids(b) == list(range(N))  # the new iterator has the pool and a whole epoch
    finally:
        dl.close()


def test_with_persistent_workers_an_iterator_that_received_everything_just_ends():
    dl = _loader("sampler", 2, persistent=True)
    try:
        a = iter(dl)
        got = [next(a) for _ in range(N // BS)]  # every batch, StopIteration not yet seen
        b = iter(dl)
        with pytest.raises(StopIteration):
            next(a)
        assert _ids(got) == _ids(b) == list(range(N))
    finally:
        dl.close()


def _mixture_loader(workers: int) -> DataLoader:
    return DataLoader(
        mix({"a": Numbers(30), "b": Numbers(10)}, {"a": 0.5, "b": 0.5}, seed=1),
        batch_size=4,
        num_workers=workers,
    )


def _keys(batch) -> list[tuple[str, int]]:
    return list(zip(batch["__source__"], batch["i"].tolist(), strict=True))


def test_a_mixture_with_workers_gives_each_iterator_its_own_epoch_in_order():
    expected = []
    ref = _mixture_loader(0)
    for _ in range(2):
        expected.append([k for b in ref for k in _keys(b)])
    dl = _mixture_loader(2)
    try:
        a, b = iter(dl), iter(dl)
        got_a, got_b = [], []
        for x, y in zip(a, b, strict=True):  # interleaved: epoch 0 and epoch 1 side by side
            got_a += _keys(x)
            got_b += _keys(y)
        assert (got_a, got_b) == (expected[0], expected[1])
    finally:
        dl.close()


def test_a_mixture_without_workers_refuses_two_iterators_at_once():
    """Without workers both iterators would read through the mixture's one epoch setting (before:
    interleaved reads of epochs 0 and 1 gave epoch 0's iterator other samples)."""
    dl = _mixture_loader(0)
    a = iter(dl)
    next(a)
    b = iter(dl)
    with pytest.raises(IteratorSupersededError, match="after 1 of 10 batch.* num_workers=0 .* orders itself"):
        next(a)
    assert len([k for x in b for k in _keys(x)]) == 40


def test_state_dict_follows_the_most_recently_created_iterator():
    dl = _loader("fast", 0)
    a = iter(dl)
    for _ in range(3):
        next(a)
    b = iter(dl)  # epoch 1
    next(b)
    st = dl.state_dict()
    assert (st["epoch"], st["consumed"]) == (1, BS)
    next(a)  # the older iterator goes on, and does not move the state
    assert dl.state_dict() == st


def test_close_ends_every_live_iterator():
    dl = _loader("fast", 2)
    a, b = iter(dl), iter(dl)
    next(a), next(b)
    dl.close()
    for it in (a, b):
        with pytest.raises(StopIteration):
            next(it)


def test_two_live_iterators_exit_cleanly_in_a_subprocess():
    """Both pools are stopped when the script ends without closing anything (no hang)."""
    script = """
    from stallfree import DataLoader, mix
    from tests.loader.helpers import Numbers
    dl = DataLoader(Numbers(100), batch_size=10, shuffle=True, num_workers=2)
    a = iter(dl); next(a); b = iter(dl); next(b)
    print("OK", flush=True)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "OK"
    assert proc.stderr.strip() == "", proc.stderr[-3000:]
