"""Remote shards: concurrent per-shard reads and opens ahead of need (stallfree.loader.worker.shards)."""

from __future__ import annotations

import queue
import threading
from collections import deque

import pytest

from stallfree.errors import ShardError
from stallfree.loader import contracts
from stallfree.loader.dataloader import DataLoader
from stallfree.loader.messages import Task
from stallfree.loader.plan import Read, ReadPath, Where, WorkerPlan
from stallfree.loader.worker import read as fetch
from stallfree.loader.worker import shards as shardio
from stallfree.loader.worker.context import WorkerContext

shards = pytest.importorskip("stallfree.shards.open")
writer = pytest.importorskip("stallfree.shards.writer")
httpserve = pytest.importorskip("stallfree.testing.httpserve")


@pytest.fixture
def served(tmp_path):
    with writer.ShardWriter(str(tmp_path / "ds"), format="tar", max_samples=7) as w:
        for i in range(40):
            w.write({"__key__": f"s{i:04d}", "txt": f"sample {i}".encode(), "cls": str(i % 3).encode()})
    with httpserve.serve_directory(tmp_path / "ds", latency_s=0.002) as srv:
        yield srv


def _idx_requests(srv) -> dict[str, int]:
    return {p: n for p, n in srv.stats.paths.items() if p.endswith(".idx")}


def test_local_datasets_are_not_wrapped(tmp_path, served):
    local = shards.open_dataset(str(tmp_path / "ds"))
    assert not contracts.wants_concurrency(local)
    assert contracts.wants_concurrency(shards.open_dataset(served.url))
    assert not contracts.wants_concurrency(list(range(5)))


def test_concurrent_get_many_is_byte_identical_and_opens_each_shard_once(served):
    remote = shards.open_dataset(served.url)
    plain = shards.open_dataset(served.url)
    cs = shardio.ConcurrentShards(remote, threads=4)
    idx = [39, 0, 8, 15, 22, 1, 29, 36, 8, 14]  # 6 shards, one index twice
    got = cs.get_many(idx)
    assert got == plain.get_many(idx)
    assert [s["__key__"] for s in got] == [f"s{i:04d}" for i in idx]
    assert got[2] is not got[8]  # a repeated index gets its own dict
    assert cs.shards_of(idx) == [5, 0, 1, 2, 3, 4]
    assert len(_idx_requests(served)) == 6 * 1  # remote opened 6 shards (plain is another reader)
    assert all(n == 2 for n in _idx_requests(served).values())  # once by cs, once by plain
    cs.close()


def test_warm_opens_shards_ahead_so_the_read_opens_nothing(served):
    remote = shards.open_dataset(served.url)
    cs = shardio.ConcurrentShards(remote, threads=4)
    cs.warm([1, 3, 3, 5])
    for fut in list(cs._opening.values()):
        fut.result()
    assert sorted(_idx_requests(served)) == ["/shard-000001.idx", "/shard-000003.idx", "/shard-000005.idx"]
    before = served.stats.requests
    assert [s["txt"] for s in cs.get_many([7, 21, 35])] == [b"sample 7", b"sample 21", b"sample 35"]
    after = {p: n for p, n in _idx_requests(served).items()}
    assert after == {"/shard-000001.idx": 1, "/shard-000003.idx": 1, "/shard-000005.idx": 1}
    assert served.stats.requests - before == 3  # one ranged read per shard, no opens
    cs.close()


def test_bad_shard_error_surfaces_from_the_read_not_the_warm_up(served, tmp_path):
    remote = shards.open_dataset(served.url)
    tar = tmp_path / "ds" / "shard-000002.tar"
    tar.write_bytes(tar.read_bytes()[:-512])  # truncated: the size check fails on open
    cs = shardio.ConcurrentShards(remote, threads=2)
    cs.warm([2])  # fails in the background, silently
    with pytest.raises(Exception) as err:
        cs.get_many([14, 0])
    assert isinstance(err.value, ShardError)
    assert "shard-000002" in str(err.value) and "truncated" in str(err.value)
    cs.close()


class _Recorder:
    """A source that records the order of warm-ups and reads (the fetch thread's contract)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[int, ...]]] = []

    def shards_of(self, indices):
        return [i // 10 for i in indices]

    def warm(self, shard_ids) -> None:
        self.events.append(("warm", tuple(shard_ids)))

    def get_many(self, indices):
        self.events.append(("read", tuple(indices)))
        return [{"__key__": str(i)} for i in indices]


def test_fetch_thread_warms_every_queued_task_before_reading_the_first():
    src = _Recorder()
    plan = WorkerPlan(dataset=None, num_workers=1, in_process=True)
    path = ReadPath(Where.AHEAD, Read.BATCHED, concurrent=True, warm_ahead=True)
    ctx = WorkerContext(0, plan, [-1] * 4, path, source=src)
    task_q: queue.Queue = queue.Queue()
    for seq, idx in enumerate([[0, 1], [15, 25], [31, 47]]):
        task_q.put(Task(0, seq, idx))
    task_q.put(None)
    ready: queue.Queue = queue.Queue()
    t = threading.Thread(target=fetch.reader_loop, args=(ctx, task_q, ready, threading.Event()))
    t.start()
    t.join(30)
    out = deque()
    while (item := ready.get_nowait()) is not None:
        out.append(item.task.indices)
    assert list(out) == [[0, 1], [15, 25], [31, 47]]
    assert src.events[:4] == [("warm", (0, 0)), ("warm", (1, 2)), ("warm", (3, 4)), ("read", (0, 1))]


def test_loader_over_http_block_order_window_spanning_shards(served):
    remote = shards.open_dataset(served.url)
    dl = DataLoader(remote, batch_size=8, shuffle=True, seed=5, num_workers=2, order="block", window=4)
    seen = []
    for b in dl:
        for key, txt in zip(b["__key__"], b["txt"], strict=True):
            assert txt == f"sample {int(key[1:])}".encode()
            seen.append(key)
    assert sorted(seen) == [f"s{i:04d}" for i in range(40)]
    assert set(_idx_requests(served).values()) <= {1, 2}  # each worker opened each shard at most once
