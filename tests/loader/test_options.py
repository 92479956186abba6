"""The planner is a pure function of (dataset, options), and options validate themselves
(issue 23.5): table tests, and the resume state kept by the index source (no mode branch in
``state_dict``)."""

from __future__ import annotations

import pytest
import torch.utils.data as tud

from stallfree import DataLoader
from stallfree.cache import MemoryCache
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.epoch.world import World
from stallfree.loader.options import LoaderOptions, plan
from tests.loader.helpers import Numbers, Sharded


class RemoteSharded(Sharded):
    class _FS:
        protocol = "s3"

    fs = _FS()


class Mixture(Numbers):
    ordered = True

    def __init__(self) -> None:
        super().__init__(16)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def per_sample(s):
    return s


class BatchDecoder:
    def decode_batch(self, samples, *, seed):
        return samples


PLANS = [
    # (dataset, options, mode, order, decode placement)
    (Numbers(8), {}, "sampler", "sequential", "none"),
    (Numbers(8), {"shuffle": True}, "fast", "global", "none"),
    (Numbers(8), {"seed": 3}, "fast", "sequential", "none"),
    (Numbers(8), {"world": World(0, 2)}, "fast", "sequential", "none"),
    (Numbers(8), {"shuffle": True, "custom_sampler": True}, "sampler", "global", "none"),
    (Numbers(8), {"shuffle": True, "batch_size": None}, "sampler", "global", "none"),
    (Numbers(8), {"decode": per_sample, "num_workers": 2}, "fast", "sequential", "sample"),
    (Numbers(8), {"decode": BatchDecoder(), "num_workers": 2}, "fast", "sequential", "main"),
    (Numbers(8), {"shuffle": True, "order": "block"}, "fast", "block", "none"),
    (Sharded(), {}, "fast", "sequential", "none"),
    (Sharded(), {"shuffle": True}, "fast", "global", "none"),
    (RemoteSharded(), {"shuffle": True}, "fast", "block", "none"),
    (RemoteSharded(), {"shuffle": True, "order": "global"}, "fast", "global", "none"),
    (Mixture(), {}, "fast", "sequential", "none"),
    (Mixture(), {"shuffle": True, "order": "global"}, "fast", "sequential", "none"),
    (Stream(), {"iterable": True}, "iterable", "sequential", "none"),
]


@pytest.mark.parametrize("dataset, fields, mode, order, where", PLANS)
def test_plan_table(dataset, fields, mode, order, where):
    p = plan(dataset, LoaderOptions(**fields))
    assert (p.mode, p.order, p.decode.where) == (mode, order, where)
    assert p == plan(dataset, LoaderOptions(**fields))  # pure: same inputs, same plan


@pytest.mark.parametrize(
    "dataset, fields, message",
    [
        (Numbers(8), {"decode": BatchDecoder(), "batch_size": None}, "needs batch_size"),
        (Mixture(), {"cache": MemoryCache(capacity_bytes=1 << 20)}, "cache= with a mixture"),
    ],
)
def test_plan_refuses_what_cannot_work(dataset, fields, message):
    with pytest.raises(ValueError, match=message):
        plan(dataset, LoaderOptions(**fields))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"on_error": "ignore"}, "on_error must be one of"),
        ({"order": "random"}, "order must be 'auto' or one of"),
        ({"uneven": "wrap"}, "uneven must be one of"),
        ({"max_failures": 1.5}, "a float is a fraction"),
        ({"decode_threads": 0}, "decode_threads must be >= 1"),
        ({"fetch_threads": 0}, "fetch_threads must be >= 1"),
        ({"memory_budget": 0}, "memory_budget must be > 0"),
        ({"iterable": True, "decode": per_sample}, "need a map-style dataset"),
    ],
)
def test_options_validate_themselves(fields, message):
    with pytest.raises(ValueError, match=message):
        LoaderOptions(**fields)


def test_options_are_frozen():
    with pytest.raises(AttributeError):
        LoaderOptions().seed = 1  # type: ignore[misc]


def test_the_loader_refuses_bad_options_like_the_options_do():
    with pytest.raises(ValueError, match="fetch_threads must be >= 1"):
        DataLoader(Numbers(4), fetch_threads=0)


@pytest.mark.parametrize(
    "kwargs, fields",
    [
        ({"shuffle": True, "seed": 1}, {"batches": 0, "dataset_len": 20}),  # fast: positions
        ({}, {"consumed": 0, "dataset_len": 20}),  # sampler: batches (the length: identity only)
    ],
)
def test_resume_state_comes_from_the_index_source(kwargs, fields):
    dl = DataLoader(Numbers(20), batch_size=4, **kwargs)
    it = iter(dl)
    first = [next(it)["i"].tolist() for _ in range(2)]
    st = dl.state_dict()
    assert all(st[k] == v for k, v in fields.items())
    assert (st["consumed"] or st["batches"] * 4) == 8
    again = DataLoader(Numbers(20), batch_size=4, **kwargs)
    again.load_state_dict(st)
    rest = [b["i"].tolist() for b in again]
    assert sorted(i for b in first + rest for i in b) == list(range(20))


def test_a_fast_state_for_another_length_is_refused():
    st = LoaderState(seed=0, epoch=0, consumed=4, dataset_len=99).to_dict()
    with pytest.raises(ValueError, match="dataset of 99 samples, this one has 20"):
        DataLoader(Numbers(20), batch_size=4, shuffle=True).load_state_dict(st)
