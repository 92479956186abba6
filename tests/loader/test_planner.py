"""One pure planner (issue 23.5): ``plan(dataset, options)`` decides the mode and order and
builds the three values the loader runs on (index source, worker plan, main plan); the
DataLoader only reads this process's facts (world, CUDA, cores) at the edge and draws a seed
where the plan asks for one. A table of dataset kinds x options -> what each part says."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud

from stallfree import DataLoader
from stallfree.cache import MemoryCache
from stallfree.loader.epoch.indices import OrderIndices, SamplerIndices, StreamIndices
from stallfree.loader.epoch.world import World
from stallfree.loader.options import LoaderOptions, plan
from stallfree.loader.plan import Read, Where
from tests.loader.helpers import Numbers, Sharded


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(4))


class Staged:
    cache_stage = "decoded"

    def __call__(self, sample):
        return sample


class MainDecoder:
    def decode_batch(self, samples, *, seed):
        return samples


class WorkerDecoder(MainDecoder):
    runs_in_workers = True


TABLE = [
    # dataset, options, (mode, order, source, read path (where, read), decode where), plan fields
    (Numbers(8), {"num_workers": 2}, ("sampler", "sequential", SamplerIndices, Where.INLINE, Read.STREAMED, "none"),
     {"seed": 0, "threads": 1, "depth": 4, "in_process": False}),
    (Numbers(8), {"shuffle": True}, ("fast", "global", OrderIndices, Where.AHEAD, Read.BATCHED, "none"),
     {"seed": None, "threads": 1, "depth": 2, "in_process": True}),
    (Numbers(8), {"shuffle": True, "seed": 5, "num_workers": 2, "prefetch_factor": 3},
     ("fast", "global", OrderIndices, Where.INLINE, Read.STREAMED, "none"),
     {"seed": 5, "threads": 1, "depth": 6, "max_slots": 4}),
    (Numbers(8), {"world": World(1, 2)}, ("fast", "sequential", OrderIndices, Where.AHEAD, Read.BATCHED, "none"),
     {"seed": 0, "world": World(1, 2)}),
    (Numbers(8), {"job_world": World(0, 4), "shuffle": True},
     ("fast", "global", OrderIndices, Where.AHEAD, Read.BATCHED, "none"), {"seed": 0, "world": World(0, 4)}),
    (Numbers(8), {"decode": Staged(), "num_workers": 2, "worker_cores": 3},
     ("fast", "sequential", OrderIndices, Where.AHEAD, Read.BATCHED, "sample"), {"threads": 3}),
    (Numbers(8), {"decode": Staged(), "num_workers": 2, "decode_threads": 2},
     ("fast", "sequential", OrderIndices, Where.AHEAD, Read.BATCHED, "sample"), {"threads": 2}),
    (Sharded(), {"decode": Staged(), "cache": MemoryCache()},
     ("fast", "sequential", OrderIndices, Where.AHEAD, Read.STAGE_CACHED, "sample"), {"cache_stage": "decoded"}),
    (Sharded(), {"cache": MemoryCache(), "fetch_threads": 3},
     ("fast", "sequential", OrderIndices, Where.POOLED, Read.BATCHED, "none"), {"cache_stage": None}),
    (Sharded(), {"decode": MainDecoder(), "num_workers": 2},
     ("fast", "sequential", OrderIndices, Where.AHEAD, Read.BATCHED, "main"), {"worker_decode": False}),
    (Sharded(), {"decode": WorkerDecoder(), "num_workers": 2},
     ("fast", "sequential", OrderIndices, Where.AHEAD, Read.BATCHED, "workers"), {"worker_decode": True}),
    (Sharded(), {"device": "cuda", "pin_memory": True},
     ("fast", "sequential", OrderIndices, Where.AHEAD, Read.BATCHED, "none"), {"device": None, "pin_memory": False}),
    (Sharded(), {"device": "cuda", "pin_memory": True, "cuda": True},
     ("fast", "sequential", OrderIndices, Where.AHEAD, Read.BATCHED, "none"),
     {"device": torch.device("cuda"), "pin_memory": True}),
    (Stream(), {"iterable": True}, ("iterable", "sequential", StreamIndices, Where.AHEAD, Read.BATCHED, "none"), {}),
]  # fmt: skip


def _fields(p) -> dict:
    w, m = p.worker, p.main
    return {
        "seed": p.seed,
        "world": p.world,
        "device": p.device,
        "threads": w.threads,
        "in_process": w.in_process,
        "max_slots": w.max_slots,
        "cache_stage": w.cache_stage,
        "depth": m.depth,
        "pin_memory": m.pin_memory,
        "worker_decode": m.worker_decode,
    }


@pytest.mark.parametrize("dataset, options, decided, fields", TABLE)
def test_the_planner_table(dataset, options, decided, fields):
    p = plan(dataset, LoaderOptions(**options))
    path = p.worker.read_path
    assert (p.mode, p.order, type(p.source), path.where, path.read, p.decode.where) == decided
    got = _fields(p)
    assert {k: got[k] for k in fields} == fields
    assert p == plan(dataset, LoaderOptions(**options))  # pure: the same inputs, the same plan


def test_the_source_follows_the_plan_and_a_seed():
    p = plan(
        Sharded(), LoaderOptions(shuffle=True, world=World(0, 2), window=3, batch_size=4, drop_last=True)
    )
    assert p.source == OrderIndices(
        dataset=p.worker.dataset,
        order="global",
        seed=0,
        world=World(0, 2),
        uneven="pad",
        window=3,
        batch_size=4,
        drop_last=True,
    )
    restored = p.with_seed(9)
    assert (restored.seed, restored.source.seed, restored.worker) == (9, 9, p.worker)


def test_a_seed_is_drawn_only_where_the_plan_asks(monkeypatch):
    """torch's RNG advances once for a one-rank shuffled loader without seed=, never otherwise:
    a sampler-mode loader draws exactly what torch's own DataLoader draws."""
    torch.manual_seed(0)
    DataLoader(Numbers(8), batch_size=2, shuffle=True)
    after_draw = torch.randint(0, 1 << 30, (1,)).item()
    torch.manual_seed(0)
    DataLoader(Numbers(8), batch_size=2)  # sampler mode: nothing drawn
    DataLoader(Numbers(8), batch_size=2, shuffle=True, seed=3)  # a seed given: nothing drawn
    untouched = torch.randint(0, 1 << 30, (1,)).item()
    torch.manual_seed(0)
    assert untouched == torch.randint(0, 1 << 30, (1,)).item() != after_draw


def test_cache_without_a_fingerprint_is_refused_when_planned():
    with pytest.raises(ValueError, match="cache= needs a dataset with a .fingerprint"):
        DataLoader(Numbers(8), batch_size=2, cache=MemoryCache())


def test_the_loader_runs_the_plan_it_made():
    """The worker plan the loader's pool runs is the planner's, with only the epoch's base seed."""
    loader = DataLoader(Sharded(), batch_size=4, decode=Staged(), num_workers=0)
    batches = [b["i"].tolist() for b in loader]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert loader._plan == plan(loader.dataset, loader._options).with_seed(loader.seed)
