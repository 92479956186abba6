"""Batch decoders that run in the worker processes (``runs_in_workers``): same seeds, same batches
as in the main process, output written where the worker's ``alloc`` says, errors named."""

from __future__ import annotations

import pytest
import torch

from stallfree.loader.dataloader import DataLoader
from tests.loader.helpers import Numbers


class SumDecoder:
    """A batch decoder: stacks ``x`` (into ``alloc``'s tensor when given) and records its seed."""

    def __init__(self, in_workers: bool, fail_on: int | None = None) -> None:
        self.runs_in_workers = in_workers
        self.fail_on = fail_on

    def decode_batch(self, samples, *, seed, alloc=None):
        if self.fail_on is not None and any(s["i"] == self.fail_on for s in samples):
            raise RuntimeError(f"decoder bug at {self.fail_on}")
        shape = (len(samples), *samples[0]["x"].shape)
        out = alloc(shape, torch.float32) if alloc is not None else None
        if out is None:
            out = torch.empty(shape)
        torch.stack([s["x"] for s in samples], out=out)
        return {"x": out, "i": [s["i"] for s in samples], "seed": seed, "allocated": alloc is not None}


def _run(in_workers: bool, **kw):
    dl = DataLoader(
        Numbers(40), batch_size=6, shuffle=True, seed=11, num_workers=2, decode=SumDecoder(in_workers), **kw
    )
    return [(b["i"], b["seed"], b["allocated"], b["x"][:, 0].tolist()) for b in dl], dl


def test_workers_get_the_same_seeds_and_order_as_the_main_process():
    main, main_dl = _run(False)
    workers, workers_dl = _run(True)
    assert [(i, seed, x) for i, seed, _, x in workers] == [(i, seed, x) for i, seed, _, x in main]
    assert all(x == [float(v) for v in i] for i, _, _, x in workers)
    assert all(allocated for _, _, allocated, _ in workers)  # written into the worker's slot
    assert not any(allocated for _, _, allocated, _ in main)
    assert len({seed for _, seed, _, _ in workers}) == len(workers)  # a seed per batch
    assert sorted(v for i, _, _, _ in workers for v in i) == list(range(40))
    assert "decode" not in workers_dl.stats() and "decode" not in main_dl.stats()  # no stats() to report


def test_a_decoder_error_in_a_worker_names_the_worker_and_batch():
    dl = DataLoader(
        Numbers(12), batch_size=4, shuffle=False, seed=0, num_workers=2, decode=SumDecoder(True, fail_on=5)
    )
    with pytest.raises(RuntimeError, match=r"decoder bug at 5") as info:
        list(dl)
    assert "in DataLoader worker process" in str(info.value) and "first index 4" in str(info.value)


def test_without_workers_the_decoder_runs_in_the_main_process():
    dl = DataLoader(Numbers(12), batch_size=4, shuffle=True, seed=0, decode=SumDecoder(True))
    assert not any(b["allocated"] for b in dl)
