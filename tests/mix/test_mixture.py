"""Mixtures: every window of positions holds each source's share (within the schedule's bound),
sources cycle through fresh permutations, and the order is a pure function of (seed, epoch)."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
import torch

import stallfree
from stallfree.loader.epoch.order import rank_share
from stallfree.mix.mixture import Mixture, MixtureMismatch, collate_by_source
from stallfree.mix.permute import keys, permute
from stallfree.mix.schedule import bound, interleave, quotas


class Items:
    """A map-style dataset of dict samples naming themselves."""

    def __init__(self, name, n):
        self.name, self.n = name, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"name": self.name, "i": i}


def sources_over_epochs(m, epochs):
    out = []
    for e in range(epochs):
        m.set_epoch(e)
        out += [s["__source__"] for s in m.get_many(range(len(m)))]
    return out


@pytest.mark.parametrize(
    "weights",
    [
        {"a": 0.7, "b": 0.3},
        {"a": 1, "b": 1, "c": 1},
        {"a": 0.5, "b": 0.3, "c": 0.15, "d": 0.05},
        {"a": 5, "b": 3, "c": 2},
    ],
)
def test_every_window_holds_the_shares_over_two_epochs(weights):
    m = Mixture(
        {n: Items(n, 37 + 11 * k) for k, n in enumerate(weights)}, weights, samples_per_epoch=997, seed=5
    )
    order = sources_over_epochs(m, 2)
    assert order == [m.source_of(i) for i in range(len(m))] * 2  # the schedule is the same every epoch
    share = {n: m.quotas[n] / len(m) for n in weights}
    limit = bound(len(weights))
    assert limit == (1.0 if len(weights) == 2 else 2 - 1 / (len(weights) - 1))
    for name in weights:
        counts = np.concatenate([[0], np.cumsum([s == name for s in order])])
        for b in (1, 2, 3, 7, 16, 32, 100, 333):
            windows = counts[b:] - counts[:-b]  # every window, aligned or not, across the epoch boundary
            assert np.abs(windows - b * share[name]).max() <= limit + 1e-9, (name, b)


def test_two_sources_within_one_for_many_shares():
    for n_a in range(1, 60):
        c = quotas(61, [n_a, 61 - n_a])
        s = interleave(c)
        p = np.concatenate([[0], np.cumsum(s == 0)])
        for b in range(1, 61):
            assert np.abs(p[b:] - p[:-b] - b * c[0] / 61).max() <= 1 + 1e-9


def test_quotas_are_exact_and_relative():
    m = Mixture({"a": Items("a", 10), "b": Items("b", 1000)}, {"a": 3, "b": 1}, samples_per_epoch=400)
    assert m.quotas == {"a": 300, "b": 100}
    assert Counter(m.source_of(i) for i in range(400)) == {"a": 300, "b": 100}
    assert len(Mixture({"a": Items("a", 10), "b": Items("b", 5)}, {"a": 1, "b": 1})) == 15


def test_cycling_counts_per_epoch():
    small, big = Items("small", 7), Items("big", 50)
    m = Mixture({"small": small, "big": big}, {"small": 0.5, "big": 0.5}, samples_per_epoch=60, seed=1)
    assert m.quotas == {"small": 30, "big": 30}
    picks = []
    for epoch in range(3):
        m.set_epoch(epoch)
        got = Counter((s["name"], s["i"]) for s in m.get_many(range(60)))
        # small repeats 30/7 = 4.29 times: each sample 4 or 5 times; big: 30 of 50, each at most once
        assert all(got[("small", i)] in (4, 5) for i in range(7))
        assert sum(got[("small", i)] for i in range(7)) == 30
        assert (
            all(got[("big", i)] in (0, 1) for i in range(50))
            and sum(got[("big", i)] for i in range(50)) == 30
        )
        order = [m.locate(i) for i in range(60) if m.source_of(i) == "small"]
        assert sorted(j for _, j in order[:7]) == list(range(7))  # a whole cycle before any repeat
        picks.append([j for _, j in order])
    assert picks[0] != picks[1] != picks[2]  # fresh permutations each epoch


def test_same_order_for_world_sizes_1_2_3():
    def make():
        return Mixture(
            {"a": Items("a", 13), "b": Items("b", 40), "c": Items("c", 5)}, {"a": 2, "b": 5, "c": 1}, seed=9
        )

    n = len(make())
    for epoch in (0, 1):
        one = make()
        one.set_epoch(epoch)
        expected = [(s["name"], s["i"]) for s in one.get_many(range(n))]
        for world in (1, 2, 3):
            per_rank = []
            for rank in range(world):  # each rank its own copy, as in its own process
                m = pickle.loads(pickle.dumps(make()))
                m.set_epoch(epoch)
                share = rank_share(np.arange(n), 0, rank, world, "drop")
                per_rank.append([(s["name"], s["i"]) for s in m.get_many(share.tolist())])
            merged = [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(world)]
            assert merged == expected[: len(merged)] and len(merged) == n - n % world


def test_locate_is_pure_in_seed_and_epoch():
    a = Mixture({"x": Items("x", 20), "y": Items("y", 9)}, {"x": 1, "y": 1}, seed=4)
    b = Mixture(
        {"y": Items("y", 9), "x": Items("x", 20)}, {"y": 1, "x": 1}, seed=4
    )  # dict order is irrelevant
    assert [a.locate(i, epoch=3) for i in range(len(a))] == [b.locate(i, epoch=3) for i in range(len(b))]
    c = Mixture({"x": Items("x", 20), "y": Items("y", 9)}, {"x": 1, "y": 1}, seed=5)
    assert [a.locate(i) for i in range(len(a))] != [c.locate(i) for i in range(len(a))]


def test_permutation_is_a_bijection():
    for n in (1, 2, 3, 5, 64, 65, 1000, 4097):
        assert sorted(permute(np.arange(n), n, keys(1, n)).tolist()) == list(range(n))


def test_source_tag_only_on_dicts():
    m = stallfree.mix({"l": [10, 20], "d": Items("d", 2)}, {"l": 1, "d": 1})
    got = [m[i] for i in range(4)]
    assert sorted(x for x in got if isinstance(x, int)) == [10, 20]
    assert sorted((x["__source__"], x["i"]) for x in got if isinstance(x, dict)) == [("d", 0), ("d", 1)]


def test_callable_package_after_submodule_import():
    import stallfree.mix.schedule  # binds the package to stallfree.mix

    assert len(stallfree.mix({"a": [1, 2]}, {"a": 1})) == 2


def test_fingerprint_and_resume_checks():
    ds = {"a": Items("a", 10), "b": Items("b", 20)}
    m = Mixture(ds, {"a": 1, "b": 1}, seed=2)
    state = m.state()
    assert state["fingerprint"] == m.fingerprint and state["weights"] == {"a": 1.0, "b": 1.0}
    Mixture(ds, {"a": 1, "b": 1}, seed=2).check_state(state)
    reweighted = Mixture(ds, {"a": 3, "b": 1}, seed=2)
    with pytest.raises(MixtureMismatch, match="weights: saved .* allow_reweight=True"):
        reweighted.check_state(state)
    reweighted.check_state(state, allow_reweight=True)
    with pytest.raises(MixtureMismatch, match="seed"):
        Mixture(ds, {"a": 1, "b": 1}, seed=3).check_state(state, allow_reweight=True)
    with pytest.raises(MixtureMismatch, match="lengths"):
        Mixture({"a": Items("a", 11), "b": ds["b"]}, {"a": 1, "b": 1}, seed=2).check_state(
            state, allow_reweight=True
        )


def test_bad_arguments():
    with pytest.raises(ValueError, match="same sources"):
        Mixture({"a": [1]}, {"b": 1})
    with pytest.raises(ValueError, match="finite number"):
        Mixture({"a": [1]}, {"a": -1})
    with pytest.raises(ValueError, match="no samples"):
        Mixture({"a": [1], "b": []}, {"a": 1, "b": 1})
    with pytest.raises(IndexError):
        Mixture({"a": [1]}, {"a": 1})[1]


@pytest.fixture
def image_and_tokens(tmp_path):
    from stallfree.testing.images import jpeg_bytes
    from tests.tokens.helpers import random_docs, write_megatron

    with stallfree.ShardWriter(str(tmp_path / "img"), format="tar") as w:
        for i, jpg in enumerate(jpeg_bytes(6, sizes=((32, 24),))):
            w.write({"__key__": f"img{i}", "jpg": jpg, "cls": i})
    write_megatron(tmp_path / "tok", random_docs(1, n=30), "int32")
    images = stallfree.open_dataset(str(tmp_path / "img"))
    tokens = stallfree.TokenDataset(str(tmp_path / "tok"), 8)
    return images, tokens


@pytest.mark.parametrize("num_workers", [0, 2])
def test_images_and_tokens_through_the_loader(image_and_tokens, num_workers):
    images, tokens = image_and_tokens
    m = stallfree.mix(
        {"images": images, "tokens": tokens}, {"images": 1, "tokens": 3}, samples_per_epoch=24, seed=1
    )
    m.set_epoch(0)
    loader = stallfree.DataLoader(m, shuffle=False, num_workers=num_workers)  # default collate, batch of 1
    got = list(loader)
    assert len(got) == 24
    for i, batch in enumerate(got):
        name, j = m.locate(i)
        assert batch["__source__"] == [name]
        if name == "images":
            assert batch["__key__"] == [images[j]["__key__"]] and batch["jpg"] == [images[j]["jpg"]]
        else:
            assert torch.equal(batch["input_ids"][0], tokens[j]["input_ids"])
    batched = stallfree.DataLoader(
        m, batch_size=8, shuffle=False, num_workers=num_workers, collate_fn=collate_by_source
    )
    for k, batch in enumerate(batched):
        assert batch["__source__"] == [m.source_of(i) for i in range(8 * k, 8 * k + 8)]
        assert Counter(batch["__source__"]) == {"images": 2, "tokens": 6}
        assert batch["tokens"]["input_ids"].shape == (6, 8) and len(batch["images"]["jpg"]) == 2
