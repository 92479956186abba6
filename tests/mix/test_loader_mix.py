"""Mixtures through stallfree.DataLoader: read in the mixture's own order on any number of ranks and
workers, epoch by epoch, with stats()["mix"], exact and elastic resume, and refused reweighting."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import stallfree
from stallfree.loader.dataloader import DataLoader
from stallfree.mix.mixture import MixtureMismatch
from tests.zygote import run_ranks

ROOT = Path(__file__).resolve().parents[2]


class Items(torch.utils.data.Dataset):
    """Dict samples naming themselves (module level: workers unpickle it)."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"name": self.name, "i": i}


def _mixture(weights=None, seed=3):
    return stallfree.mix(
        {"web": Items("web", 50), "code": Items("code", 17), "books": Items("books", 7)},
        weights or {"web": 0.6, "code": 0.3, "books": 0.1},
        samples_per_epoch=90,
        seed=seed,
    )


def _keys(batch) -> list[tuple[str, int]]:
    return list(zip(batch["__source__"], batch["i"].tolist(), strict=True))


def _expected(epoch: int) -> list[tuple[str, int]]:
    m = _mixture()
    return [m.locate(i, epoch) for i in range(len(m))]


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)])
def test_the_loader_reads_the_mixture_in_its_own_order_every_epoch(num_workers, persistent):
    dl = DataLoader(
        _mixture(), batch_size=8, shuffle=True, num_workers=num_workers, persistent_workers=persistent
    )
    for epoch in range(2):
        got = [k for b in dl for k in _keys(b)]
        assert got == _expected(epoch)  # shuffle does not undo the interleave; the epoch is followed
        st = dl.stats()["mix"]
        assert st["epoch"] == epoch and st["positions"] == [0, 90]
        assert st["delivered"] == dict(Counter(name for name, _ in got))


def test_ranks_split_the_mixture_by_position():
    shares = []
    for rank in range(3):
        dl = DataLoader(_mixture(), batch_size=4, world=(rank, 3), num_workers=0)
        shares.append([k for b in dl for k in _keys(b)])
    assert [len(s) for s in shares] == [30, 30, 30]
    interleaved = [shares[i % 3][i // 3] for i in range(90)]
    assert interleaved == _expected(0)  # the same order as one rank reads, whatever the world size


def test_resume_mid_epoch_on_the_same_and_on_fewer_ranks_loses_and_repeats_nothing():
    def take(world: int, state=None, batches=None):
        out, states = [], []
        for rank in range(world):
            dl = DataLoader(_mixture(), batch_size=5, world=(rank, world), num_workers=2)
            if state is not None:
                dl.load_state_dict(state)
            it = iter(dl)
            got = [k for b in itertools.islice(it, batches) for k in _keys(b)]
            out.append(got)
            states.append(dl.state_dict())
        return out, states

    first, states = take(3, batches=2)  # 3 ranks x 2 batches x 5 = positions 0..29
    assert states[0] == states[1] == states[2]  # position based: every rank saves the same state
    assert json.loads(json.dumps(states[0])) == states[0]
    for world in (3, 2):
        rest, _ = take(world, state=states[0])
        seen = Counter(k for part in first + rest for k in part)
        assert seen == Counter(_expected(0))  # each position exactly once (90 splits evenly)


def test_a_state_for_other_weights_is_refused_unless_asked():
    dl = DataLoader(_mixture(), batch_size=5, num_workers=0)
    it = iter(dl)
    next(it)
    state = dl.state_dict()
    other = DataLoader(_mixture({"web": 0.5, "code": 0.4, "books": 0.1}), batch_size=5, num_workers=0)
    with pytest.raises(MixtureMismatch, match="allow_reweight=True"):
        other.load_state_dict(state)
    other.load_state_dict(state, allow_reweight=True)
    assert [k for k in _keys(next(iter(other)))] == [
        other.dataset.locate(i, 0) for i in range(5, 10)
    ]  # goes on from the saved position of the new order
    with pytest.raises(MixtureMismatch, match="seed"):
        DataLoader(_mixture(seed=4), batch_size=5).load_state_dict(state, allow_reweight=True)


def test_cache_with_a_mixture_is_refused():
    from stallfree.cache import MemoryCache

    with pytest.raises(ValueError, match="cache its sources"):
        DataLoader(_mixture(), batch_size=4, cache=MemoryCache(capacity_bytes=1 << 20))


def _gloo_rank(rank: int, world: int, init_file: str, out: str, state_json: str, batches: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # workers fork, as they do under torchrun (a rank started by torch's spawn would default to
        # spawn, and every spawned worker would import torch again: seconds each, nothing tested)
        dl = DataLoader(_mixture(), batch_size=5, num_workers=1, multiprocessing_context="fork")
        assert dl.world.size == world
        if state_json:
            dl.load_state_dict(json.loads(state_json))
        it = iter(dl)
        got = [k for b in itertools.islice(it, batches or None) for k in _keys(b)]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"got": got, "state": dl.state_dict()})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


_RANK = """
import sys
from tests.mix.test_loader_mix import _gloo_rank
rank, world, init_file, out, state_json, batches = sys.argv[1:]
_gloo_rank(int(rank), int(world), init_file, out, state_json, int(batches))
"""
RANK_TIMEOUT = 300  # a bound on a hang, not a speed requirement


@pytest.mark.slow
def test_elastic_resume_3_to_2_gloo_ranks(tmp_path):
    def run(world: int, name: str, state: str, batches: int) -> list:
        out = str(tmp_path / f"{name}.json")
        run_ranks(
            _RANK,
            world,
            str(tmp_path / f"init-{name}"),
            out,
            state,
            str(batches),
            timeout=RANK_TIMEOUT,
            cwd=ROOT,
        )
        with open(out) as f:
            return json.load(f)

    first = run(3, "a", "", 3)  # 3 ranks x 3 batches x 5: positions 0..44
    state = json.dumps(first[0]["state"])
    rest = run(2, "b", state, 0)  # 45 left for 2 ranks: one padded position, the epoch's first
    seen = Counter(tuple(k) for part in first + rest for k in part["got"])
    want = _expected(0)
    assert seen == Counter(want) + Counter([want[0]])
