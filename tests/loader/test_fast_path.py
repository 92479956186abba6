"""The fast path: rank split, seeded order, exact resume, error policy, worker failures, memory."""

from __future__ import annotations

import json
import logging

import psutil
import pytest
import torch

from stallfree.errors import BatchDecodeError
from stallfree.loader.dataloader import DataLoader
from stallfree.loader.errors import FailureBudgetExceeded, WorkerDiedError, WorkerHungError
from tests.loader.helpers import Big, Dies, Failing, Hangs, Numbers, WhoAmI, indices


def test_three_ranks_two_workers_every_sample_once_with_drop():
    per_rank, counts = [], []
    for rank in range(3):
        dl = DataLoader(
            Numbers(61), batch_size=4, shuffle=True, num_workers=2, seed=5, world=(rank, 3), uneven="drop"
        )
        batches = list(dl)
        counts.append(len(batches))
        assert len(batches) == len(dl)
        per_rank.append([i for b in batches for i in b["i"].tolist()])
    flat = sum(per_rank, [])
    assert len(set(counts)) == 1
    assert len(flat) == len(set(flat)) == 60  # drop: 61 % 3 = 1 sample left out this epoch
    assert all(len(set(a) & set(b)) == 0 for a in per_rank for b in per_rank if a is not b)


def test_three_ranks_pad_covers_every_sample_and_repeats_only_the_pad():
    per_rank = [
        indices(DataLoader(Numbers(61), batch_size=4, shuffle=True, num_workers=2, seed=5, world=(r, 3)))
        for r in range(3)
    ]
    flat = sum(per_rank, [])
    assert {len(p) for p in per_rank} == {21}
    assert set(flat) == set(range(61)) and len(flat) == 63  # pad: 2 samples seen twice


def test_order_same_seed_same_order_new_epoch_new_order():
    a = DataLoader(Numbers(40), batch_size=5, shuffle=True, seed=11)
    b = DataLoader(Numbers(40), batch_size=5, shuffle=True, num_workers=2, seed=11)
    e0a, e1a = indices(a), indices(a)
    e0b = indices(b)
    assert e0a == e0b and sorted(e0a) == list(range(40))
    assert e1a != e0a and sorted(e1a) == list(range(40))
    assert indices(DataLoader(Numbers(40), batch_size=5, shuffle=True, seed=12)) != e0a
    b.set_epoch(1)
    assert indices(b) == e1a


@pytest.mark.parametrize("stop_after", [0, 3, 8, 10])  # start, middle, last-but-partial, end
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_yields_exactly_the_rest(stop_after, num_workers):
    full = indices(DataLoader(Numbers(38), batch_size=4, shuffle=True, seed=3))
    dl = DataLoader(
        Numbers(38),
        batch_size=4,
        shuffle=True,
        seed=3,
        num_workers=num_workers,
        prefetch_factor=None if not num_workers else 3,
    )
    it = iter(dl)
    seen = []
    for _ in range(stop_after):
        seen += next(it)["i"].tolist()
    state = json.loads(json.dumps(dl.state_dict()))  # mid-prefetch: workers are ahead of us here
    del it
    dl2 = DataLoader(Numbers(38), batch_size=4, shuffle=True, seed=99, num_workers=num_workers)
    dl2.load_state_dict(state)
    rest = indices(dl2)
    if stop_after >= 10:
        assert state["epoch"] == 1 and state["consumed"] == 0
        assert sorted(rest) == list(range(38))  # next epoch in full
    else:
        assert seen + rest == full


def test_set_epoch_of_the_restored_epoch_keeps_the_position():
    """Frameworks call set_epoch(e) at the top of every epoch, the resumed one too (transformers'
    Trainer does): that call must not restart the epoch a restored state is in; another epoch does."""
    full = indices(DataLoader(Numbers(38), batch_size=4, shuffle=True, seed=3))
    dl = DataLoader(Numbers(38), batch_size=4, shuffle=True, seed=3)
    it = iter(dl)
    seen = [i for _ in range(3) for i in next(it)["i"].tolist()]
    state = dl.state_dict()
    del it
    resumed = DataLoader(Numbers(38), batch_size=4, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    resumed.set_epoch(0)  # twice (a framework hook and the user's loop): still the restored position
    assert seen + indices(resumed) == full
    resumed.set_epoch(0)  # after the restored iteration began, set_epoch moves again
    assert indices(resumed) == full
    moved = DataLoader(Numbers(38), batch_size=4, shuffle=True, seed=3)
    moved.load_state_dict(state)
    moved.set_epoch(1)
    assert sorted(indices(moved)) == list(range(38)) and moved.state_dict()["epoch"] == 2


@pytest.mark.parametrize("new_world", [3, 6])
def test_resume_four_ranks_onto_three_and_six(new_world):
    n, bs = 120, 5
    loaders = [DataLoader(Numbers(n), batch_size=bs, shuffle=True, seed=21, world=(r, 4)) for r in range(4)]
    seen, states = [], []
    for dl in loaders:
        it = iter(dl)
        for _ in range(3):
            seen += next(it)["i"].tolist()
        states.append(dl.state_dict())
    assert len({json.dumps(s) for s in states}) == 1 and states[0]["consumed"] == 60
    rest = []
    counts = set()
    for r in range(new_world):
        dl = DataLoader(Numbers(n), batch_size=bs, shuffle=True, world=(r, new_world), num_workers=r % 2)
        dl.load_state_dict(states[0])
        got = indices(dl)
        counts.add(len(got))
        rest += got
    assert len(counts) == 1
    assert sorted(seen + rest) == list(range(n))


def test_resume_uneven_onto_three_ranks_pads_without_losing():
    state = DataLoader(Numbers(50), batch_size=5, shuffle=True, seed=2, world=(0, 4))
    it = iter(state)
    next(it)
    st = state.state_dict()
    assert st["consumed"] == 20
    rest = sum((indices(_loaded(Numbers(50), st, (r, 3))) for r in range(3)), [])
    full = indices(DataLoader(Numbers(50), batch_size=50, shuffle=True, seed=2))
    assert set(rest) == set(full[20:]) and len(rest) == 30


def _loaded(ds, st, world):
    dl = DataLoader(ds, batch_size=5, shuffle=True, world=world)
    dl.load_state_dict(st)
    return dl


def test_state_dict_rejects_other_dataset_length():
    st = DataLoader(Numbers(10), shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="dataset of 10 samples"):
        DataLoader(Numbers(11), shuffle=True).load_state_dict(st)


def test_worker_info_and_init_fn_in_fast_path():
    seen_init = []
    dl = DataLoader(
        WhoAmI(24), batch_size=3, shuffle=True, num_workers=2, seed=0, worker_init_fn=seen_init.append
    )
    workers = {
        (w, nw) for b in dl for w, nw in zip(b["worker"].tolist(), b["nworkers"].tolist(), strict=False)
    }
    assert workers == {(0, 2), (1, 2)}
    in_main = {
        w for b in DataLoader(WhoAmI(6), batch_size=3, shuffle=True, seed=0) for w in b["worker"].tolist()
    }
    assert in_main == {-1}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_raise_names_worker_and_sample(num_workers):
    dl = DataLoader(Failing(20, {13}), batch_size=4, shuffle=True, seed=0, num_workers=num_workers)
    with pytest.raises(ValueError, match="bad sample 13") as err:
        list(dl)
    if num_workers:
        assert "in DataLoader worker process" in str(err.value) and "index 13" in str(err.value)


def test_on_error_skip_drops_failed_samples_and_counts_them():
    dl = DataLoader(Failing(20, {2, 7}), batch_size=4, shuffle=True, seed=0, num_workers=2, on_error="skip")
    got = indices(dl)
    assert sorted(got) == sorted(set(range(20)) - {2, 7})
    st = dl.stats()
    assert st["failures"] == 2 and sorted(st["failed_keys"]) == ["index 2", "index 7"]  # read failed: no key


def test_on_error_warn_logs(caplog):
    dl = DataLoader(Failing(12, {5}), batch_size=4, shuffle=True, seed=0, on_error="warn")
    with caplog.at_level(logging.WARNING, logger="stallfree.loader.assembler"):
        got = indices(dl)
    assert 5 not in got and len(got) == 11
    assert any("sample at index 5" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("budget, allowed", [(2, 2), (0.1, 3)])  # 0.1 of a 30-sample epoch = 3
def test_failure_budget_stops_with_failed_keys(budget, allowed):
    dl = DataLoader(
        Failing(30, {1, 4, 9, 16, 25}),
        batch_size=3,
        shuffle=True,
        seed=0,
        on_error="skip",
        max_failures=budget,
    )
    with pytest.raises(FailureBudgetExceeded, match="max_failures") as err:
        list(dl)
    assert len(err.value.failed) > allowed and f"allows ({allowed})" in str(err.value)
    assert all(k in {f"index {i}" for i in (1, 4, 9, 16, 25)} for _, k, _ in err.value.failed)


def test_worker_death_is_an_error_naming_worker_and_sample():
    dl = DataLoader(Dies(24, at=9), batch_size=3, shuffle=True, seed=0, num_workers=2)
    with pytest.raises(
        WorkerDiedError, match=r"exited unexpectedly: worker \d, exit code 7, while reading sample 9 "
    ):
        list(dl)


def test_worker_hang_is_an_error_naming_worker_and_sample():
    dl = DataLoader(Hangs(12, at=4), batch_size=2, shuffle=True, seed=0, num_workers=2, worker_timeout=1.0)
    with pytest.raises(WorkerHungError, match=r"made no progress .* while reading sample 4 "):
        list(dl)


def test_timeout_argument_like_torch():
    dl = DataLoader(Hangs(12, at=4), batch_size=2, shuffle=True, seed=0, num_workers=1, timeout=0.5)
    with pytest.raises(RuntimeError) as got:
        list(dl)
    assert str(got.value) == "DataLoader timed out after 0.5 seconds"  # torch's message, exactly
    # what the worker was doing, truthfully, in a note beside torch's message
    assert any("worker 0 while reading sample 4 " in note for note in got.value.__notes__)


class _Decoder:
    """A decode_batch object: stacks the x fields; fails for keys listed in ``bad``."""

    def __init__(self, bad=()):
        self.bad = set(bad)
        self.calls = 0
        self.seeds = []

    def decode_batch(self, samples, *, seed):
        self.calls += 1
        self.seeds.append(seed)
        fails = [
            (p, s["__key__"], ValueError("corrupt"))
            for p, s in enumerate(samples)
            if s["__key__"] in self.bad
        ]
        if fails:
            raise BatchDecodeError(fails)
        return {"x": torch.stack([s["x"] for s in samples]), "i": torch.tensor([s["i"] for s in samples])}

    def stats(self):
        return {"backend": "test", "calls": self.calls}


def test_decode_batch_contract_skip_and_stats():
    dec = _Decoder(bad={"k0003"})
    dl = DataLoader(
        Failing(16, set()), batch_size=4, shuffle=True, seed=0, num_workers=2, decode=dec, on_error="skip"
    )
    got = indices(dl)
    assert sorted(got) == sorted(set(range(16)) - {3})
    st = dl.stats()
    assert st["decode"]["backend"] == "test" and st["failures"] == 1
    assert st["stages_s"]["decode_batch_s"] >= 0


def test_decode_batch_raise():
    dl = DataLoader(Failing(8, set()), batch_size=4, shuffle=True, seed=0, decode=_Decoder(bad={"k0001"}))
    with pytest.raises(BatchDecodeError, match="k0001"):
        list(dl)


def _add_one(sample):
    return {**sample, "x": sample["x"] + 1}


def test_per_sample_decode_runs_in_workers():
    dl = DataLoader(Numbers(8), batch_size=4, shuffle=True, seed=0, num_workers=2, decode=_add_one)
    for b in dl:
        assert torch.equal(b["x"][:, 0], b["i"].float() + 1)


def test_stats_fields_and_pin_memory_without_cuda():
    dl = DataLoader(
        Numbers(32), batch_size=4, shuffle=True, seed=0, num_workers=2, pin_memory=True, device="cpu"
    )
    assert len(indices(dl)) == 32
    st = dl.stats()
    assert st["batches"] == 8 and st["samples"] == 32 and st["path"] == "fast"
    assert {"data_wait_s", "compute_s", "samples_per_s", "queue", "stages_s"} <= set(st)
    assert {"fetch_s", "map_s", "collate_s", "transfer_s"} <= set(st["stages_s"])
    assert 0 <= st["queue"]["mean_occupancy"] <= st["queue"]["capacity"]


def _tree_rss() -> int:
    me = psutil.Process()
    return me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))


def test_memory_bounded_over_twenty_epochs():
    dl = DataLoader(
        Big(32, 256 * 1024), batch_size=4, shuffle=True, seed=0, num_workers=2, persistent_workers=True
    )
    rss = []
    for _ in range(20):
        for b in dl:
            assert b["x"].shape == (4, 64 * 1024)
        rss.append(_tree_rss())
    # one batch is 1 MiB; steady state must not climb epoch after epoch
    assert rss[-1] - rss[2] < 16 * 2**20, [r // 2**20 for r in rss]
    assert dl.stats()["epochs_completed"] == 20


@pytest.mark.parametrize("persistent", [False, True])
def test_kept_batches_stay_intact_while_slots_are_recycled(persistent):
    dl = DataLoader(
        Big(40, 64 * 1024), batch_size=2, shuffle=True, seed=0, num_workers=2, persistent_workers=persistent
    )
    for _ in range(2):
        kept = list(dl)  # the consumer keeps every batch: no slot may be reused under it
        assert len(kept) == 20
        for b in kept:
            for i, row in zip(b["i"].tolist(), b["x"], strict=True):
                assert torch.equal(row, torch.full_like(row, float(i)))
        del kept


def test_memory_bounded_when_the_consumer_keeps_whole_epochs():
    """Kept batches force extra slots; once they are dropped the pool shrinks back (no creep)."""
    dl = DataLoader(
        Big(32, 256 * 1024), batch_size=4, shuffle=True, seed=0, num_workers=2, persistent_workers=True
    )
    rss = []
    for _ in range(20):
        kept = list(dl)
        del kept
        rss.append(_tree_rss())
    assert rss[-1] - rss[3] < 8 * 2**20, [r // 2**20 for r in rss]


@pytest.mark.parametrize("shuffle", [True, False])
def test_persistent_workers_survive_abandoned_epochs(shuffle):
    dl = DataLoader(
        Numbers(30), batch_size=4, shuffle=shuffle, num_workers=2, persistent_workers=True, seed=1
    )
    for _ in range(3):
        it = iter(dl)
        next(it)  # abandon: its prefetched batches are still on their way back
        del it
        got = indices(dl)
        assert sorted(got) == list(range(30))
    assert dl._engine is not None and all(p.is_alive() for p in dl._engine.procs)
    dl.close()
    assert dl._engine is None
