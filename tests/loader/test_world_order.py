"""world.py and order.py: plain arithmetic, no processes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stallfree.loader.epoch import order
from stallfree.loader.epoch.state import LoaderState
from stallfree.loader.epoch.world import World, resolve_world, split_for_worker, world_from_env


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
    # the rest, on 5 ranks, is exactly what is left; on 3 ranks padding repeats (-40 % 3) samples:
    # the epoch's first two positions, already consumed before the resume
    rest = np.concatenate([order.rank_share(o, 20, r, 5) for r in range(5)])
    assert sorted(rest.tolist()) == sorted(o[20:].tolist())
    rest3 = np.concatenate([order.rank_share(o, 20, r, 3) for r in range(3)]).tolist()
    assert sorted(rest3) == sorted(o[20:].tolist() + o[:2].tolist())


def test_batches_drop_last():
    s = np.arange(10)
    assert [len(b) for b in order.batches(s, 4, False)] == [4, 4, 2]
    assert [len(b) for b in order.batches(s, 4, True)] == [4, 4]


def test_state_roundtrip_json_and_validation():
    st = LoaderState(seed=3, epoch=2, consumed=17, dataset_len=40, order="block/r1/window=8")
    d = json.loads(json.dumps(st.to_dict()))
    assert LoaderState.from_dict(d) == st and d["order"] == "block/r1/window=8"
    bare = LoaderState(seed=3, epoch=2, consumed=17, dataset_len=40)  # torch's sampler: no order
    assert "order" not in bare.to_dict() and LoaderState.from_dict(bare.to_dict()).order is None
    with pytest.raises(ValueError, match="not a stallfree loader state"):
        LoaderState.from_dict({"seed": 1})
    with pytest.raises(ValueError, match="unsupported loader state version"):
        LoaderState.from_dict({**d, "version": 99})


# -- exact resume, padded tail included ------------------------------------------------------
# Ns chosen so every remainder n % world occurs, including n < world and n == 0.
_NS = [0, 1, 2, 5, 7, 10, 13, 31, 50]
_WORLDS = [1, 2, 3, 4, 5, 8]


def _uninterrupted(o: np.ndarray, world_size: int, uneven: str) -> list[list[int]]:
    return [order.rank_share(o, 0, r, world_size, uneven).tolist() for r in range(world_size)]


@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_resume_on_same_world_continues_exactly_for_every_resume_point(uneven):
    """Every (n, world, k): after each rank received k samples, the resumed shares are exactly the
    rest of the uninterrupted shares, padded tail included (the pad samples wrap to the epoch's
    start, as in the uninterrupted run, not to the resume point)."""
    for n in _NS:
        o = order.global_order(5, 1, n)
        for w in _WORLDS:
            full = _uninterrupted(o, w, uneven)
            per_rank = len(full[0])
            for k in range(per_rank + 1):
                start = order.consumed_after(0, k, w, n)
                for r in range(w):
                    got = order.rank_share(o, start, r, w, uneven).tolist()
                    assert got == full[r][k:], (n, w, k, r)


def test_resume_twice_on_same_world_continues_exactly():
    for n in _NS:
        o = order.global_order(2, 0, n)
        for w in _WORLDS:
            full = _uninterrupted(o, w, "pad")
            per_rank = len(full[0])
            for k1 in range(per_rank + 1):
                s1 = order.consumed_after(0, k1, w, n)
                for k2 in range(per_rank - k1 + 1):
                    s2 = order.consumed_after(s1, k2, w, n)
                    for r in range(w):
                        assert order.rank_share(o, s2, r, w).tolist() == full[r][k1 + k2 :], (n, w, k1, k2)


def test_issue_case_1000_samples_3_ranks_padding_matches_uninterrupted():
    o = order.global_order(0, 0, 1000)
    full = _uninterrupted(o, 3, "pad")
    start = order.consumed_after(0, 40, 3, 1000)  # 10 batches of 4 on every rank
    for r in range(3):
        resumed = order.rank_share(o, start, r, 3).tolist()
        assert resumed[-1] == full[r][-1]
    # the padding is the epoch's first positions, received again by ranks 1 and 2
    assert [full[1][-1], full[2][-1]] == o[:2].tolist()


@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_resume_on_other_world_loses_and_repeats_nothing_beyond_padding(uneven):
    """Saved on ``w`` after k samples per rank, resumed on ``w2``: together the two runs see every
    sample of the epoch; with pad exactly ``(-(n - start)) % w2`` repeats (the resumed run's
    padding, taken from the epoch's start) and with drop no repeat and ``(n - start) % w2`` left
    out, always the last positions."""
    for n in _NS:
        o = order.global_order(9, 3, n)
        for w in _WORLDS:
            per_rank = len(order.rank_share(o, 0, 0, w, uneven))
            for k in range(per_rank + 1):
                before = [x for r in range(w) for x in order.rank_share(o, 0, r, w, uneven)[:k].tolist()]
                start = order.consumed_after(0, k, w, n)
                if uneven == "drop" or start < n:
                    assert sorted(before) == sorted(o[:start].tolist()), (n, w, k)
                for w2 in _WORLDS:
                    shares = [order.rank_share(o, start, r, w2, uneven).tolist() for r in range(w2)]
                    assert len({len(s) for s in shares}) == 1, (n, w, k, w2)
                    # back into position order: position i went to rank i % w2
                    after = [shares[i % w2][i // w2] for i in range(w2 * len(shares[0]))]
                    rest = n - start
                    if uneven == "pad":
                        seen = sorted(o[:start].tolist() + after)
                        pad = (-rest) % w2 if rest else 0
                        assert len(after) == rest + pad, (n, w, k, w2)
                        assert set(seen) == set(range(n)), (n, w, k, w2)
                        # the repeats are the epoch's first positions, cycled
                        assert after[rest:] == np.resize(o, pad).tolist(), (n, w, k, w2)
                        assert sorted(after[:rest]) == sorted(o[start:].tolist())
                    else:
                        assert len(after) == len(set(after)) == rest - rest % w2, (n, w, k, w2)
                        assert set(after) == set(o[start : n - rest % w2].tolist())


def _collect(loader, limit=None):
    """Sample indices of the first ``limit`` batches (all when None), fetching no batch more."""
    out = []
    for b, batch in enumerate(loader, 1):
        out.extend(batch["i"].tolist())
        if b == limit:
            break
    return out


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_dataloader_resume_on_3_ranks_matches_uninterrupted_including_padding(rank):
    """The issue's case end to end: 1,000 samples over 3 ranks, state after 10 batches, resume."""
    from stallfree import DataLoader
    from tests.loader.helpers import Numbers

    ds = Numbers(1000, width=1)
    whole = _collect(DataLoader(ds, batch_size=8, shuffle=True, seed=11, world=(rank, 3)))
    assert len(whole) == 334
    first = DataLoader(ds, batch_size=8, shuffle=True, seed=11, world=(rank, 3))
    head = _collect(first, limit=10)
    state = json.loads(json.dumps(first.state_dict()))
    again = DataLoader(ds, batch_size=8, shuffle=True, seed=11, world=(rank, 3))
    again.load_state_dict(state)
    tail = _collect(again)
    assert head + tail == whole
    if rank:  # ranks 1 and 2 end on a padding sample: the epoch's first positions
        assert whole[-1] == order.global_order(11, 0, 1000)[rank - 1]
