"""Mixture weights that change with the global sample position: exact counts per stage, the
per-window bound inside each stage, linear / cosine / function schedules, resume exactly at
random steps across world sizes 1-8 and stage boundaries, and achieved vs target fractions in
``stats()`` and the TensorBoard export."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import numpy as np
import pytest

import stallfree
from stallfree.loader.dataloader import DataLoader
from stallfree.loader.export import flatten_stats
from stallfree.mix import schedule as sched_mod
from stallfree.mix.mixture import MixtureMismatch
from stallfree.trace.audit import audit
from tests.trace.helpers import Items, mixture_keys, three_stage_mixture


def _sources():
    return {"web": Items("web", 40), "code": Items("code", 17), "math": Items("math", 9)}


def test_each_stage_gets_exact_counts_and_the_window_bound_inside_it():
    m = three_stage_mixture()
    n = len(m)
    stages = [
        (0, 53, {"web": 0.7, "code": 0.3, "math": 0.0}),
        (53, 171, {"web": 0.4, "code": 0.4, "math": 0.2}),
    ]
    src = np.concatenate([m.locate_many(np.arange(n), e)[0] for e in range(3)])  # global positions 0..290
    names = m.names
    for lo, hi, weights in stages:
        want = sched_mod.quotas(hi - lo, [weights[x] for x in names])
        assert np.bincount(src[lo:hi], minlength=3).tolist() == want.tolist()
        share = want / (hi - lo)
        bound = sched_mod.bound(int((want > 0).sum()))
        for size in (1, 2, 5, 13):  # every window inside the stage, aligned or not
            for a in range(lo, hi - size + 1):
                got = np.bincount(src[a : a + size], minlength=3)
                assert np.all(np.abs(got - size * share) <= bound + 1e-9), (lo, a, size, got)
    assert m.counts(0, n, epoch=2)["math"] == sum(1 for s in src[194:291] if names[s] == "math")


def test_every_source_cycles_through_its_samples_across_epochs_and_stages():
    m = three_stage_mixture()
    picks: dict[str, list[int]] = {x: [] for x in m.names}
    for e in range(4):
        src, idx = m.locate_many(np.arange(len(m)), e)
        for s, i in zip(src.tolist(), idx.tolist(), strict=True):
            picks[m.names[s]].append(i)
    for name, seq in picks.items():
        size = m.lengths[name]
        for c in range(len(seq) // size):  # each whole cycle is a permutation of the source
            assert sorted(seq[c * size : (c + 1) * size]) == list(range(size)), name


def test_linear_and_cosine_move_between_their_weights():
    n = 4000
    lin = stallfree.mix(
        _sources(),
        stallfree.mix.linear(
            [(0, {"web": 1, "code": 0, "math": 0}), (n, {"web": 0, "code": 0, "math": 1})], resolution=100
        ),
        samples_per_epoch=n,
    )
    assert lin.target_shares(50) == pytest.approx({"web": 0.9875, "code": 0.0, "math": 0.0125})
    math = [lin.counts(a, a + 400)["math"] for a in range(0, n, 400)]
    assert math == sorted(math) and math[0] < 40 and math[-1] > 360
    assert lin.target_shares(0, epoch=5) == {"web": 0.0, "code": 0.0, "math": 1.0}  # the last point holds
    cos = stallfree.mix(
        _sources(),
        stallfree.mix.cosine(
            {"web": 1, "code": 1, "math": 0},
            {"web": 0, "code": 1, "math": 1},
            start=1000,
            end=3000,
            resolution=50,
        ),
        samples_per_epoch=n,
    )
    web = [cos.counts(a, a + 500)["web"] for a in range(0, n, 500)]
    assert web[:2] == [250, 250] and web[-2:] == [0, 0] and web == sorted(web, reverse=True)
    mid = cos.target_shares(2000)
    assert mid["web"] == pytest.approx(mid["math"], abs=0.02)  # half way along the cosine


def test_a_function_schedule_is_its_table_and_a_changed_function_is_refused():
    def fn(progress):
        return {"web": 1.0 - progress, "code": 0.5, "math": progress}

    m = stallfree.mix(
        _sources(), stallfree.mix.from_function(fn, total=1000, resolution=100), samples_per_epoch=500
    )
    assert m.target_shares(50) == pytest.approx({"web": 0.95 / 1.5, "code": 0.5 / 1.5, "math": 0.05 / 1.5})
    again = stallfree.mix(
        _sources(), stallfree.mix.from_function(fn, total=1000, resolution=100), samples_per_epoch=500
    )
    again.check_state(m.state())
    drawn = random.Random(1)
    other = stallfree.mix(
        _sources(),
        stallfree.mix.from_function(
            lambda p: {"web": drawn.random(), "code": 0.5, "math": p}, total=1000, resolution=100
        ),
        samples_per_epoch=500,
    )
    with pytest.raises(MixtureMismatch, match="schedule"):
        other.check_state(m.state())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: stallfree.mix.stages([(5, {"a": 1})]), "first point must be at position 0"),
        (lambda: stallfree.mix.stages([(0, {"a": 1}), (0, {"a": 2})]), "positions must increase"),
        (lambda: stallfree.mix.stages([(0, {"a": 1}), (9, {"b": 2})]), "names"),
        (lambda: stallfree.mix.linear([(0, {"a": -1})]), "finite number >= 0"),
        (lambda: stallfree.mix.cosine({"a": 1}, {"a": 2}, start=5, end=5), "must come after"),
        (lambda: stallfree.mix.from_function(lambda p: {"a": 0.0}, total=10), "not be all 0"),
        (lambda: stallfree.mix.linear([(0, {"a": 1}), (10**12, {"a": 2})], resolution=1), "raise resolution"),
    ],
)
def test_bad_schedules_are_clear_errors(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_a_schedule_naming_other_sources_is_refused():
    with pytest.raises(ValueError, match="the mixture's sources"):
        stallfree.mix(_sources(), stallfree.mix.stages([(0, {"web": 1, "code": 1})]))


_CHECK = three_stage_mixture()


def _read(world, state, keys_dir, steps, epochs=2):
    """Run ``world`` ranks from ``state`` for ``steps`` steps (None: to the end of ``epochs``
    epochs); every batch is checked against the mixture at the positions samples_at names."""
    last = None
    for rank in range(world):
        dl = DataLoader(three_stage_mixture(), batch_size=4, world=(rank, world), record_keys=keys_dir)
        if state is not None:
            dl.load_state_dict(state)
        step = 0 if state is None else state["step"]
        stream = itertools.chain.from_iterable(iter(dl) for _ in range(epochs))
        for batch in itertools.islice(stream, steps):
            if step % 3 == rank % 3:  # a third of the batches: the audit covers every one
                found = dl.samples_at(step)
                assert mixture_keys(batch) == [_CHECK.locate(p, found.epoch) for p in found.positions]
            step += 1
        last = dl.state_dict()
        dl.close()
    return last


def test_resume_at_20_random_steps_across_world_sizes_and_stage_boundaries(tmp_path):
    draw = random.Random(34)
    stages = set()
    for trial in range(20):
        before, after = draw.randint(1, 8), draw.randint(1, 8)
        lo, hi = ((1, 53), (53, 171), (171, 194))[trial % 3]  # a resume inside each stage in turn
        per_step = 4 * before
        first = -(-lo // per_step)
        stop = draw.randint(first, max(first, (hi - 1) // per_step))
        keys = tmp_path / f"keys{trial}"
        state = _read(before, None, keys, stop)
        at = state["epoch"] * 97 + state["consumed"]
        stages.add((at >= 53) + (at >= 171))
        _read(after, state, keys, None, epochs=2 - state["epoch"])  # to the end of epoch 1
        report = audit(keys)
        assert report.ok, (trial, before, after, stop, report.first)
        assert [report.epochs[e]["delivered"] for e in (0, 1)] == [97, 97]
        assert report.epochs[0]["complete"] and report.epochs[1]["complete"]
    assert stages == {0, 1, 2}  # resumed inside each of the three stages


def test_stats_report_achieved_fractions_beside_the_targets():
    dl = DataLoader(three_stage_mixture(), batch_size=5, world=(0, 2))
    it = iter(dl)
    for _ in range(8):  # 80 positions: past the first stage boundary at 53
        next(it)
    mix = dl.stats()["mix"]
    frac = mix["fractions"]
    assert frac["target"] == pytest.approx({"web": 0.4, "code": 0.4, "math": 0.2})
    m = three_stage_mixture()
    window = Counter(m.locate(p, 0)[0] for p in range(70, 80))
    assert frac["window"] == {x: window[x] / 10 for x in m.names}
    upto = Counter(m.locate(p, 0)[0] for p in range(80))
    assert frac["cumulative"] == pytest.approx({x: upto[x] / 80 for x in m.names})
    flat = flatten_stats(dl.stats())
    assert flat["mix/fractions/target/math"] == pytest.approx(0.2)  # TensorBoard's tags
    assert "mix/fractions/window/web" in flat and "mix/fractions/cumulative/code" in flat
