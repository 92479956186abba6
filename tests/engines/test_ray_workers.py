"""RayWorkers on a real Ray cluster on loopback (tests/engines/conftest.py: one per module).

The loader with remote workers delivers exactly the samples of the local loader, in the same
order, with 0 or 2 local workers beside them; a state saved mid-epoch with remote workers resumes
into one remote worker and into none; a bad sample follows on_error and is named with its key
and its node; the actors run on the CPU nodes, never the trainer's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

pytestmark = pytest.mark.slow  # the cluster takes ~10-25 s to start on two cores

N = 96
BATCH = 8


def decode(sample: dict) -> dict:
    """The per-sample stage the workers run: bytes -> tensor (a bad sample raises, naming its key)."""
    raw = sample["bin"]
    if raw.startswith(b"BAD"):
        raise ValueError(f"corrupt payload in {sample['__key__']}")
    return {
        "key": sample["__key__"],
        "x": torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64),
    }


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    import ray.cloudpickle

    # the actors cannot import this test module by name: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    from stallfree.shards import ShardWriter, open_dataset

    root = tmp_path_factory.mktemp("ray_ds") / "ds"
    with ShardWriter(str(root), max_samples=16) as w:
        for i in range(N):
            payload = b"BAD!" if i == 37 else bytes([i % 251]) * 16
            w.write({"__key__": f"s{i:04d}", "bin": payload})
    return open_dataset(str(root))


def loader_for(dataset, num_workers: int, remote, **kw):
    from stallfree import DataLoader

    return DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        seed=7,
        num_workers=num_workers,
        decode=decode,
        on_error=kw.pop("on_error", "skip"),
        remote=remote,
        **kw,
    )


def keys_of(batches) -> list[str]:
    return [k for b in batches for k in b["key"]]


def expected_keys() -> set[str]:
    return {f"s{i:04d}" for i in range(N) if i != 37}


def test_the_cluster_is_on_loopback_and_the_actors_on_the_cpu_nodes(ray_cluster, dataset):
    import ray

    assert ray_cluster.address.startswith("127.0.0.1:")
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    assert sorted(n.resources.get("stallfree_cpu", 0) for n in ray_cluster.worker_nodes) == [1.0, 1.0]
    from stallfree import RayWorkers

    remote = RayWorkers(2, resources={"stallfree_cpu": 1})
    loader = loader_for(dataset, 0, remote)
    try:
        next(iter(loader))
        placed = {a.node.remote() for a in remote._actors}
        node_ids = {info.node_id for info in ray.get(list(placed))}
    finally:
        loader.close()
    assert node_ids == {n.node_id for n in ray_cluster.worker_nodes}  # one per CPU node, none on the head


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exactly_once_and_the_local_order(ray_cluster, dataset, num_workers):
    from stallfree import RayWorkers

    local = loader_for(dataset, num_workers, None)
    want = keys_of(local)
    remote = RayWorkers(2, resources={"stallfree_cpu": 1})
    loader = loader_for(dataset, num_workers, remote)
    try:
        got = keys_of(loader)
        stats = loader.stats()
    finally:
        loader.close()
    assert got == want  # the same batches in the same order: one dispatcher, one order
    assert sorted(got) == sorted(expected_keys())
    assert len(got) == len(set(got))
    remote_stats = stats["remote"]
    assert remote_stats["batches_remote"] > 0
    assert remote_stats["batches_remote"] + remote_stats["batches_local"] == N // BATCH
    if num_workers:
        assert remote_stats["batches_local"] > 0  # the trainer's own workers first
    else:
        assert remote_stats["batches_local"] == 0  # never the training loop's own core
    workers = remote_stats["workers"]
    assert sorted(workers) == [max(1, num_workers), max(1, num_workers) + 1]
    assert {w["node"] for w in workers.values()} == {"127.0.0.1"}
    assert sum(w["batches"] for w in workers.values()) == remote_stats["batches_remote"]
    assert all(w["bytes_sent"] > 0 and w["cpu_s"] > 0 for w in workers.values() if w["batches"])
    from stallfree.loader.export import flatten_stats

    flat = flatten_stats(stats)  # what TensorBoard and the JSON lines get
    assert flat["remote/batches_remote"] == remote_stats["batches_remote"]
    first = min(workers)
    assert flat[f"remote/workers/{first}/batches"] == workers[first]["batches"]


def test_resume_mid_epoch_into_one_remote_worker_and_into_none(ray_cluster, dataset):
    from stallfree import RayWorkers

    first = loader_for(dataset, 0, RayWorkers(2, resources={"stallfree_cpu": 1}))
    it = iter(first)
    head = keys_of([next(it) for _ in range(4)])
    state = first.state_dict()
    del it
    first.close()
    for remote in (RayWorkers(1, resources={"stallfree_cpu": 1}), None):
        resumed = loader_for(dataset, 0 if remote is not None else 1, remote)
        resumed.load_state_dict(state)
        try:
            tail = keys_of(resumed)
        finally:
            resumed.close()
        assert len(head) + len(tail) == len(expected_keys())
        assert sorted(head + tail) == sorted(expected_keys())  # nothing lost, nothing twice


def test_a_corrupt_sample_raises_naming_its_key_and_node(ray_cluster, dataset):
    from stallfree import RayWorkers

    loader = loader_for(dataset, 0, RayWorkers(2, resources={"stallfree_cpu": 1}), on_error="raise")
    seen: list[str] = []
    error = None
    try:
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001 - the batch's error; iteration goes on
                error = exc
                continue
            seen += batch["key"]
    finally:
        loader.close()
    assert error is not None
    text = str(error)
    assert "s0037" in text and "corrupt payload" in text
    assert "remote worker" in text and "Ray node 127.0.0.1" in text
    assert "s0037" not in seen
    assert len(seen) == N - BATCH  # only the bad sample's batch failed; the epoch went on


def test_a_corrupt_sample_is_skipped_and_counted(ray_cluster, dataset):
    from stallfree import RayWorkers

    loader = loader_for(dataset, 0, RayWorkers(2, resources={"stallfree_cpu": 1}), on_error="skip")
    try:
        got = keys_of(loader)
        stats = loader.stats()
    finally:
        loader.close()
    assert sorted(got) == sorted(expected_keys())
    assert stats["failures"] == 1
    assert stats["failed_keys"] == ["s0037"]
    assert sum(w["failures"] for w in stats["remote"]["workers"].values()) == 1


class Numbers(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_remote_takes_only_remote_workers_and_map_style_data():
    from stallfree import DataLoader, RayWorkers

    with pytest.raises(TypeError, match="remote= takes a stallfree.RayWorkers, got object"):
        DataLoader(Numbers(), batch_size=2, remote=object())
    with pytest.raises(ValueError, match="remote= needs a map-style dataset"):
        DataLoader(Stream(), batch_size=2, remote=RayWorkers(1))
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        RayWorkers(0)
    with pytest.raises(ValueError, match="on_lost must be one of"):
        RayWorkers(1, on_lost="ignore")


UNREACHABLE = """
import socket
from torch.utils.data import Dataset
from stallfree import DataLoader, RayWorkers
from stallfree.engines.ray_workers import RemoteClusterError

class Numbers(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()  # nothing listens there now
loader = DataLoader(Numbers(), batch_size=2, remote=RayWorkers(1, address=f"127.0.0.1:{port}", connect_timeout_s=0.5))
try:
    next(iter(loader))
except RemoteClusterError as exc:
    print("ERROR", exc, "PORT", port)
"""


def test_an_unreachable_cluster_is_a_clear_error_naming_its_address(tmp_path: Path):
    pytest.importorskip("ray")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(UNREACHABLE)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    port = line.rsplit("PORT", 1)[1].strip()
    assert line.startswith(f"ERROR cannot reach the Ray cluster at '127.0.0.1:{port}'"), line


def test_the_example_trains_every_sample_once_across_two_ranks(ray_cluster, tmp_path: Path):
    """examples/train_ray_remote.py under torchrun (two ranks, gloo, loopback), each rank with one
    local worker and one remote worker on the loopback cluster: every sample trained once."""
    import json
    import os
    import socket

    from stallfree.harness.fixtures import write_jpeg_shards

    root = Path(__file__).resolve().parents[2]
    data = write_jpeg_shards(tmp_path / "ds", 48, per_shard=12, size=(64, 48))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
        str(root / "examples" / "train_ray_remote.py"),
        "--data", str(data), "--ray-address", ray_cluster.address, "--remote-workers", "1",
        "--resource", "stallfree_cpu", "--workers", "1", "--batch-size", "4", "--size", "32",
        "--ckpt", str(tmp_path / "ckpt.pt"), "--log-keys", str(tmp_path / "keys"),
    ]  # fmt: skip
    env = {**ray_cluster.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    keys = [
        k
        for rank in (0, 1)
        for line in (tmp_path / f"keys.{rank}").read_text().splitlines()
        for k in json.loads(line)["keys"]
    ]
    assert sorted(keys) == [f"{i:08d}" for i in range(48)]
    summaries = [
        json.loads(line.split("remote: ", 1)[1]) for line in r.stdout.splitlines() if " remote: " in line
    ]
    assert len(summaries) == 2 and all(s["batches_remote"] > 0 for s in summaries), r.stdout
    assert os.path.exists(tmp_path / "ckpt.pt")


def test_a_dataset_on_the_s3_server_is_read_by_the_remote_workers(ray_cluster):
    """The remote workers open the dataset from its URL themselves (the loopback S3 server of the
    tests, moto): exactly once, the bytes as written, batches made remotely."""
    from stallfree import DataLoader, RayWorkers
    from stallfree.shards import ShardWriter, open_dataset
    from stallfree.testing.s3serve import moto_available, serve_s3

    reason = moto_available()
    if reason is not None:
        pytest.skip(reason)
    with serve_s3() as s3:
        s3.create_bucket("ray")
        url = "s3://ray/ds"
        written = {f"s{i:03d}": bytes([i]) * (100 + i) for i in range(40)}
        with ShardWriter(url, max_samples=10, **s3.storage_options) as w:
            for key, payload in written.items():
                w.write({"__key__": key, "bin": payload})
        loader = DataLoader(
            open_dataset(url, **s3.storage_options),
            batch_size=4,
            shuffle=True,
            seed=3,
            collate_fn=list,
            remote=RayWorkers(2, resources={"stallfree_cpu": 1}),
        )
        try:
            got = {s["__key__"]: s["bin"] for batch in loader for s in batch}
            stats = loader.stats()["remote"]
        finally:
            loader.close()
    assert got == written
    assert stats["batches_remote"] == 10 and stats["batches_local"] == 0


def test_a_persistent_pool_serves_two_epochs_with_the_same_actors(ray_cluster, dataset):
    from stallfree import RayWorkers

    remote = RayWorkers(2, resources={"stallfree_cpu": 1})
    loader = loader_for(dataset, 1, remote, persistent_workers=True)
    try:
        first = keys_of(loader)
        actors = list(remote._actors)
        second = keys_of(loader)
        assert remote._actors == actors  # kept across epochs, not placed again
        stats = loader.stats()["remote"]
    finally:
        loader.close()
    assert sorted(first) == sorted(second) == sorted(expected_keys())
    assert first != second  # epoch 1's order is another permutation
    assert stats["batches_remote"] + stats["batches_local"] == 2 * (N // BATCH)
    assert remote._actors == []  # close() stopped them


def test_the_bench_shows_where_each_batch_was_made_with_and_without_remote(ray_cluster, tmp_path, capsys):
    """``stallfree bench --loader stallfree,stallfree-remote`` on the loopback cluster, one rank in
    this process: both loaders' rows, and per worker where the batches the loop took were made.
    The data is one epoch of the loop's steps: the counters count a batch when it is made, so a
    loop stopping mid-epoch would leave batches made ahead of it."""
    import json

    from stallfree.cli import main

    out = tmp_path / "bench.json"
    steps, warmup, batch = 10, 2, 4
    argv = [
        "bench", f"synthetic:{(steps + warmup) * batch}", "--loader", "stallfree,stallfree-remote",
        "--ray-address", ray_cluster.address, "--remote-workers", "2", "--remote-resource", "stallfree_cpu",
        "--nproc", "1", "--workers", "1", "--steps", str(steps), "--warmup", str(warmup),
        "--batch-size", str(batch), "--step-ms", "1", "--image-size", "16", "--device", "cpu",
        "--decode", "recipe", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert set(report["loaders"]) == {"stallfree", "stallfree-remote"}
    lines = text.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("loader ")))  # the stall table
    assert [line.split()[:2] for line in lines[head + 2 : head + 4]] == [
        ["stallfree", "job"],
        ["stallfree-remote", "job"],
    ]
    assert "where_made" not in report["loaders"]["stallfree"]
    (rank,) = report["loaders"]["stallfree-remote"]["where_made"]["ranks"]
    assert rank["taken"] == steps + warmup
    rows = rank["rows"]
    assert sum(r["batches"] for r in rows) == rank["made"] == rank["taken"]
    local, remote = rows[0], rows[1:]
    assert local["label"] == "local worker 0" and local["node"] == "trainer"
    assert [r["worker"] for r in remote] == [1, 2]  # after the one local worker
    assert {r["node"] for r in remote} == {"127.0.0.1"}
    assert sum(r["batches"] for r in remote) == rank["made_remote"] > 0
    assert all(r["bytes_sent"] > 0 and r["cpu_s"] > 0 for r in remote if r["batches"])
    assert report["remote_effect"]["with"] == "stallfree-remote"
    for r in remote:  # the text section names each remote worker with its node and batches
        assert any(
            line.split()[:7]
            == ["stallfree-remote", "0", "remote", "worker", str(r["worker"]), "127.0.0.1", str(r["batches"])]
            for line in lines
        ), text
    assert any(line.startswith("stall with remote workers: ") for line in lines), text


HEAP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def test_inline_bytes_and_keep_heap_set_the_actors_environment_only():
    from stallfree import RayWorkers

    assert RayWorkers(1)._runtime_env() == {
        "env_vars": {
            "RAY_max_direct_call_object_size": str(64 << 20),
            "RAY_task_rpc_inlined_bytes_limit": str(2 * (64 << 20)),  # in_flight=2 replies
            **HEAP,
        }
    }
    user = {"py_modules": ["/x"], "env_vars": {"RAY_max_direct_call_object_size": "1000", "A": "b"}}
    env = RayWorkers(1, runtime_env=user, inline_bytes=1 << 20)._runtime_env()
    assert env == {
        "py_modules": ["/x"],
        "env_vars": {
            "RAY_max_direct_call_object_size": "1000",  # the user's own setting wins
            "RAY_task_rpc_inlined_bytes_limit": str(2 << 20),
            "A": "b",
            **HEAP,
        },
    }
    assert user == {"py_modules": ["/x"], "env_vars": {"RAY_max_direct_call_object_size": "1000", "A": "b"}}
    assert RayWorkers(1, inline_bytes=0)._runtime_env() == {"env_vars": HEAP}
    assert RayWorkers(1, runtime_env=user, inline_bytes=0, keep_heap=False)._runtime_env() is user
    assert RayWorkers(1, inline_bytes=0, keep_heap=False)._runtime_env() is None
    with pytest.raises(ValueError, match="inline_bytes must be an int >= 0"):
        RayWorkers(1, inline_bytes=-1)


@pytest.mark.parametrize("inline_bytes", [64 << 20, 0])
def test_a_batch_sized_return_comes_back_inline_unless_told_otherwise(ray_cluster, dataset, inline_bytes):
    """What a remote worker returns (a MiB here, as a batch would be) comes back in its task's
    reply with ``inline_bytes`` (no object store holds it), through the CPU node's store with 0."""
    import os

    import numpy as np
    import ray
    from ray.experimental import get_object_locations

    from stallfree import RayWorkers

    remote = RayWorkers(1, resources={"stallfree_cpu": 1}, inline_bytes=inline_bytes)
    loader = loader_for(dataset, 0, remote)
    try:
        next(iter(loader))
        actor = remote._actors[0]
        node_id = ray.get(actor.node.remote()).node_id
        ref = actor.__ray_call__.remote(lambda self: np.full(1 << 20, 7, dtype=np.uint8))
        ray.wait([ref], fetch_local=False, timeout=60)
        where = get_object_locations([ref])[ref]
        value = ray.get(ref)
        environ = ray.get(actor.__ray_call__.remote(lambda self: dict(os.environ)))
    finally:
        loader.close()
    assert value.nbytes == 1 << 20 and int(value[-1]) == 7
    assert {k: environ.get(k) for k in HEAP} == HEAP  # keep_heap: the actor's malloc settings
    if inline_bytes:
        assert where["node_ids"] == []  # in the trainer's own memory: no store holds it
    else:
        assert node_id in where["node_ids"]  # in the CPU node's object store
