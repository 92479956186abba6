"""The run's timeline (loader/epoch/timeline.py) against the rank shares it stands for, at seeded
random spans and skips; and a resume state's timeline fields, checked when loaded."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stallfree.loader.dataloader import DataLoader
from stallfree.loader.epoch.order import Kept, RankShare, Sequential, batches
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.epoch.timeline import Span, Timeline
from tests.trace.test_skips import Numbers


def _walk(n, spans_until, skips_at=()):
    """What ranks deliver, simulated with RankShare batch by batch: step -> (epoch, {rank: positions})."""
    out = {}
    step = 0
    for (first, epoch, start, world, bs), until in spans_until:
        assert first == step
        e, p = epoch, start
        while step < until:
            skipped = tuple((lo, hi) for se, lo, hi in skips_at if se == e)
            shares = [RankShare(Sequential(n), p, r, world, "pad", skipped) for r in range(world)]
            plans = [batches(s, bs, False) for s in shares]
            for b in range(len(plans[0])):
                if step >= until:
                    break
                out[step] = (
                    e,
                    {
                        r: shares[r].positions(np.arange(b * bs, min((b + 1) * bs, len(shares[r]))))
                        for r in range(world)
                    },
                )
                step += 1
            else:
                e, p = e + 1, 0
                continue
            break
    return out


@pytest.mark.parametrize("seed", range(8))
def test_place_matches_the_rank_shares_across_spans(seed):
    draw = random.Random(seed)
    n = draw.randint(20, 90)
    timeline = Timeline(n)
    plan, step, epoch, start = [], 0, 0, 0
    for _ in range(draw.randint(1, 4)):
        world, bs = draw.randint(1, 5), draw.randint(1, 6)
        span = Span(step, epoch, start, world, bs)
        timeline = timeline.extend(span)
        length = draw.randint(1, 3 * n // (world * bs) + 1)
        plan.append(((step, epoch, start, world, bs), step + length))
        # where that span stops: the next starts there
        place = timeline.place(step + length)
        step, epoch = step + length, place.epoch
        start = min(place.start + place.batch * world * bs, n)
    walked = _walk(n, plan)
    for s, (e, per_rank) in walked.items():
        place = timeline.place(s)
        assert place.epoch == e, (s, place)
        for r, positions in per_rank.items():
            assert place.positions(Sequential(n), r).tolist() == positions.tolist()


def test_step_of_inverts_place_and_a_skip_leaves_out_whole_global_batches():
    n = 57
    t = Timeline(n).extend(Span(0, 0, 0, 3, 4))
    for step in range(40):
        place = t.place(step)
        start = place.batch * 12
        assert t.step_of(place.epoch, min(start, n)) == step
    skipped = t.with_skip(6, 9, at=Span(2, 0, 24, 3, 4))
    # 19 reads per rank an epoch: 5 steps; steps 6-8 are epoch 1's batches 1-3, positions 12-47
    assert [(k.epoch, k.lo, k.hi, k.steps) for k in skipped.skips] == [(1, 12, 48, (6, 9))]
    kept = Kept(n, skipped.skipped_in(1, skipped.spans[-1]))
    left_out = set(range(n)) - set(kept.pos(np.arange(len(kept))).tolist())
    held = {int(p) for s in (6, 7, 8) for r in range(3) for p in t.place(s).positions(Sequential(n), r)}
    assert left_out == held
    assert (
        skipped.place(6).positions(Sequential(n), 0).tolist()
        == t.place(9).positions(Sequential(n), 0).tolist()
    )


def test_a_resumed_loader_continues_the_timeline_it_loaded():
    first = DataLoader(Numbers(), batch_size=4, shuffle=True, seed=5, world=(1, 3))
    it = iter(first)
    got = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    assert state["step"] == 3 and state["history"] == [
        {
            "step": 0,
            "epoch": 0,
            "start": 0,
            "world_size": 3,
            "batch_size": 4,
            "drop_last": False,
            "uneven": "pad",
        }
    ]
    again = DataLoader(Numbers(), batch_size=4, shuffle=True, seed=5, world=(1, 3))
    again.load_state_dict(state)
    assert [again.samples_at(s).indices for s in range(3)] == got
    assert again.samples_at(3).indices == next(iter(again)).tolist()
    assert again.state_dict()["history"] == state["history"]  # the same world: no new span


def test_a_state_saved_before_the_layout_move_loads_and_a_bad_history_is_refused():
    dl = DataLoader(Numbers(), batch_size=4, shuffle=True, seed=5)
    next(iter(dl))
    state = dl.state_dict()
    assert state["format"] == "stallfree.loader.state"  # the name on disk, not a module path
    old = {k: v for k, v in state.items() if k not in ("step", "history", "skips")}
    fresh = DataLoader(Numbers(), batch_size=4, shuffle=True, seed=5)
    fresh.load_state_dict(old)  # saved before steps were recorded: steps count from this resume
    assert fresh.state_dict()["step"] == 0
    assert LoaderState.from_dict({**state, "format": "stallfree.loader.epoch.state"}).consumed == 4
    bad = {**state, "history": [{"step": 0, "epoch": 0, "start": 0, "world_size": 0, "batch_size": 4}]}
    with pytest.raises(ValueError, match="world_size"):
        DataLoader(Numbers(), batch_size=4, shuffle=True, seed=5).load_state_dict(bad)
    with pytest.raises((TypeError, ValueError), match="history"):
        LoaderState.from_dict({**state, "history": "nope"})


def test_a_loop_that_rewinds_every_pass_keeps_a_bounded_timeline(monkeypatch):
    from stallfree.loader.epoch import timeline as timeline_mod

    monkeypatch.setattr(timeline_mod, "KEEP_SPANS", 5)
    dl = DataLoader(Numbers(), batch_size=50, shuffle=True, seed=5)
    for _ in range(9):  # an evaluation loop that reads epoch 0 again each time
        dl.set_epoch(0)
        for _ in dl:
            pass
    state = dl.state_dict()
    assert state["step"] == 27 and len(state["history"]) == 5
    assert [h["step"] for h in state["history"]] == [12, 15, 18, 21, 24]
    with pytest.raises(ValueError, match="before this timeline"):
        dl.samples_at(3)
    assert dl.samples_at(25).indices == dl.samples_at(22).indices  # epoch 0 again, batch 1
