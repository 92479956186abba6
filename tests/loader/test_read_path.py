"""A worker's read stage is chosen once, by one pure function (plan.read_path): a table of
plans and the path each gets (issue 23.4: it was chosen in five places)."""

from __future__ import annotations

import pytest
import torch.utils.data as tud

from stallfree.cache import MemoryCache
from stallfree.loader.plan import Read, ReadPath, Where, WorkerPlan, read_path
from stallfree.shards.open import open_dataset
from stallfree.shards.writer import ShardWriter
from stallfree.testing.httpserve import serve_directory


class Plain(tud.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        return {"i": i}


class GetItems(Plain):
    def __getitems__(self, indices: list) -> list:
        return [self[i] for i in indices]


class GetItemsOff(Plain):
    __getitems__ = None  # torch's switch: set but falsy, so torch reads dataset[i]


class Many(Plain):
    fingerprint = "f" * 16
    shard_sizes = [4]

    def get_many(self, indices: list) -> list:
        return [self[i] for i in indices]


class Collated(Many):
    def get_batch(self, indices: list) -> dict:
        return {"i": list(indices)}


class Stage:
    cache_stage = "decoded"

    def __call__(self, sample: dict) -> dict:
        return sample


def decode(sample: dict) -> dict:
    return sample


class WorkerDecoder:
    runs_in_workers = True

    def decode_batch(self, samples: list, *, seed: int, alloc=None) -> dict:
        return {}


CACHE = MemoryCache(capacity_bytes=1 << 20)

CASES = {
    # plan fields -> (where, read)
    "plain dataset: inline, one sample at a time": (dict(dataset=Plain()), Where.INLINE, Read.STREAMED),
    "torch's __getitems__ with batching: inline, once per batch": (
        dict(dataset=GetItems()),
        Where.INLINE,
        Read.GETITEMS,
    ),
    "__getitems__ = None: inline, per sample": (dict(dataset=GetItemsOff()), Where.INLINE, Read.STREAMED),
    "__getitems__ without batching: read per sample, as torch": (
        dict(dataset=GetItems(), auto_collation=False, map_fn=decode),
        Where.AHEAD,
        Read.PER_SAMPLE,
    ),
    "a user collate_fn still reads a plain dataset inline": (
        dict(dataset=Plain(), collate_fn=list),
        Where.INLINE,
        Read.STREAMED,
    ),
    "in process: no inline rows (no shared slots)": (
        dict(dataset=Plain(), in_process=True),
        Where.AHEAD,
        Read.BATCHED,
    ),
    "per-sample decode: a fetch thread reads ahead": (
        dict(dataset=Plain(), map_fn=decode),
        Where.AHEAD,
        Read.BATCHED,
    ),
    "batched reads: ahead": (dict(dataset=Many()), Where.AHEAD, Read.BATCHED),
    "fetch_threads > 1: a pool": (dict(dataset=Many(), fetch_threads=4), Where.POOLED, Read.BATCHED),
    "get_batch and the default collate: on the main thread": (
        dict(dataset=Collated()),
        Where.MAIN,
        Read.COLLATED,
    ),
    "get_batch with a pool": (dict(dataset=Collated(), fetch_threads=3), Where.POOLED, Read.COLLATED),
    "get_batch, but a collate_fn: batched": (
        dict(dataset=Collated(), collate_fn=list),
        Where.AHEAD,
        Read.BATCHED,
    ),
    "get_batch, but a cache: batched through it": (
        dict(dataset=Collated(), cache=CACHE),
        Where.AHEAD,
        Read.BATCHED,
    ),
    "get_batch, but a worker batch decoder": (
        dict(dataset=Collated(), batch_decode=WorkerDecoder()),
        Where.AHEAD,
        Read.BATCHED,
    ),
    "get_batch, but the main process decodes raw samples": (
        dict(dataset=Collated(), send_raw=True),
        Where.AHEAD,
        Read.BATCHED,
    ),
    "a stage-cached decode": (
        dict(dataset=Many(), map_fn=Stage(), cache=CACHE, cache_stage="decoded"),
        Where.AHEAD,
        Read.STAGE_CACHED,
    ),
    "a stage name but raw samples sent: not stage-cached": (
        dict(dataset=Many(), cache=CACHE, cache_stage="decoded", send_raw=True),
        Where.AHEAD,
        Read.BATCHED,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_read_path_table(name):
    fields, where, read = CASES[name]
    plan = WorkerPlan(num_workers=2, **fields)
    path = read_path(plan)
    assert (path.where, path.read) == (where, read)
    assert path == plan.read_path  # one function, whoever asks
    assert not path.concurrent and not path.warm_ahead  # local datasets: no shard concurrency


def test_a_remote_sharded_dataset_reads_concurrently_and_warms_ahead_without_a_cache(tmp_path):
    with ShardWriter(str(tmp_path / "ds"), format="tar", max_samples=2) as w:
        for i in range(4):
            w.write({"__key__": f"s{i:04d}", "txt": b"x"})
    local = open_dataset(str(tmp_path / "ds"))
    assert read_path(WorkerPlan(dataset=local, num_workers=1)) == ReadPath(Where.AHEAD, Read.BATCHED)
    with serve_directory(tmp_path / "ds") as srv:
        ds = open_dataset(srv.url)
        assert read_path(WorkerPlan(dataset=ds, num_workers=1)) == ReadPath(
            Where.AHEAD, Read.BATCHED, concurrent=True, warm_ahead=True
        )
        cached = read_path(WorkerPlan(dataset=ds, num_workers=1, cache=CACHE))
        assert cached == ReadPath(Where.AHEAD, Read.BATCHED, concurrent=True, warm_ahead=False)
