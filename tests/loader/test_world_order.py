"""world.py and order.py: plain arithmetic, no processes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stallfree.loader import order
from stallfree.loader.state import LoaderState
from stallfree.loader.world import World, resolve_world, split_for_worker, world_from_env


def test_world_fields_and_node():
    w = World(rank=5, size=8, local_rank=1, local_size=4)
    assert (w.node, w.num_nodes) == (1, 2)
    assert w.as_dict() == {"rank": 5, "size": 8, "local_rank": 1, "local_size": 4, "node": 1}


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"rank": 3, "size": 3}, "rank 3 outside"),
        ({"rank": 0, "size": 0}, "world size must be"),
        ({"rank": 0, "size": 6, "local_rank": 0, "local_size": 4}, "not a multiple"),
    ],
)
def test_world_rejects_bad_values(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        World(**kwargs)


def test_world_from_env_edge_function():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert world_from_env(env) == World(rank=3, size=4, local_rank=1, local_size=2)
    assert world_from_env({}) is None


def test_resolve_world_forms():
    assert resolve_world(None) == World()
    assert resolve_world((1, 3)).rank == 1 and resolve_world((1, 3)).size == 3
    assert resolve_world({"rank": 2, "size": 4}) == World(rank=2, size=4)
    with pytest.raises(TypeError):
        resolve_world("rank0")


def test_split_for_worker_partitions():
    parts = [list(split_for_worker(10, w, 3)) for w in range(3)]
    assert sorted(sum(parts, [])) == list(range(10))
    assert parts[0] == [0, 3, 6, 9]


def test_global_order_pure_and_epoch_dependent():
    a = order.global_order(7, 0, 100)
    assert np.array_equal(a, order.global_order(7, 0, 100))
    assert not np.array_equal(a, order.global_order(7, 1, 100))
    assert not np.array_equal(a, order.global_order(8, 0, 100))
    assert sorted(a.tolist()) == list(range(100))


def test_block_order_keeps_windows_of_shards_together():
    sizes = [10, 7, 13, 10, 5, 9]
    o = order.block_order(3, 0, sizes, window=2)
    assert sorted(o.tolist()) == list(range(sum(sizes)))
    starts = np.cumsum([0, *sizes])
    shard_of = np.searchsorted(starts, o, side="right") - 1
    # each window of 2 shards is contiguous in the order: at most 2 distinct shards per window run
    pos = 0
    for _ in range(3):
        group = set(shard_of[pos : pos + 1].tolist())
        run = pos
        while run < len(o) and (shard_of[run] in group or len(group) < 2):
            group.add(int(shard_of[run]))
            run += 1
        assert len(group) <= 2
        pos = run
    assert pos == len(o)
    with pytest.raises(ValueError, match="shard_sizes sum"):
        order.epoch_order(0, 0, 5, mode="block", shard_sizes=[2, 2])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_rank_shares_pad_cover_everything_equally(world_size):
    o = order.global_order(0, 0, 50)
    shares = [order.rank_share(o, 0, r, world_size, "pad") for r in range(world_size)]
    assert len({len(s) for s in shares}) == 1
    flat = np.concatenate(shares).tolist()
    assert set(flat) == set(range(50))
    assert len(flat) - 50 == (-50) % world_size  # documented: pad repeats this many


@pytest.mark.parametrize("world_size", [3, 4, 7])
def test_rank_shares_drop_are_disjoint(world_size):
    o = order.global_order(0, 0, 50)
    shares = [order.rank_share(o, 0, r, world_size, "drop") for r in range(world_size)]
    flat = np.concatenate(shares).tolist()
    assert len(flat) == len(set(flat)) == 50 - 50 % world_size


def test_consumed_prefix_is_independent_of_world_size():
    o = order.global_order(1, 2, 60)
    # 4 ranks each received 5 samples: exactly the first 20 positions are consumed
    got = np.concatenate([order.rank_share(o, 0, r, 4)[:5] for r in range(4)])
    assert sorted(got.tolist()) == sorted(o[: order.consumed_after(0, 5, 4, 60)].tolist())
    # the rest, on 5 ranks, is exactly what is left; on 3 ranks padding repeats (40 % 3) samples
    rest = np.concatenate([order.rank_share(o, 20, r, 5) for r in range(5)])
    assert sorted(rest.tolist()) == sorted(o[20:].tolist())
    rest3 = np.concatenate([order.rank_share(o, 20, r, 3) for r in range(3)]).tolist()
    assert set(rest3) == set(o[20:].tolist()) and len(rest3) == 42


def test_batches_drop_last():
    s = np.arange(10)
    assert [len(b) for b in order.batches(s, 4, False)] == [4, 4, 2]
    assert [len(b) for b in order.batches(s, 4, True)] == [4, 4]


def test_state_roundtrip_json_and_validation():
    st = LoaderState(seed=3, epoch=2, consumed=17, dataset_len=40)
    d = json.loads(json.dumps(st.to_dict()))
    assert LoaderState.from_dict(d) == st
    with pytest.raises(ValueError, match="not a stallfree loader state"):
        LoaderState.from_dict({"seed": 1})
    with pytest.raises(ValueError, match="unsupported loader state version"):
        LoaderState.from_dict({**d, "version": 99})
