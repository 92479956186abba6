"""Two nodes with their own addresses, storage 10 ms away: torchrun across the nodes (c10d
rendezvous on node0), a `stallfree cache serve` Redis per node bound to the node's address with its
password, a training loop over stallfree.DataLoader with the cluster cache spanning both nodes.

Shown: epoch 1 reads the data from storage about once, epoch 2 almost nothing; every sample exactly
once per epoch; a node's cache server killed mid-epoch costs misses, not samples; the cache servers
listen on their node's address only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stallfree
from stallfree.cache.credentials import ensure_secret_file
from stallfree.testing.netlab import NetLab, unavailable_reason

REASON = unavailable_reason()
TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}"),
    pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed beside this Python"),
]

HERE = Path(__file__).parent
REPO = HERE.parent.parent
SAMPLES, SAMPLE_BYTES = 192, 6000
DELAY_S = 0.010  # one way, storage <-> every node
HTTP_PORT, RELAY_PORT, CACHE_PORT, RDZV_PORT = 7100, 8100, 6380, 29400


def _write_dataset(root: Path) -> tuple[set[str], int]:
    rng = np.random.default_rng(0)
    keys = set()
    with stallfree.ShardWriter(str(root), format="tar", max_samples=48) as w:
        for i in range(SAMPLES):
            key = f"s{i:05d}"
            keys.add(key)
            w.write({"__key__": key, "bin": rng.bytes(SAMPLE_BYTES), "cls": i % 7})
    payload = sum(p.stat().st_size for p in root.glob("*.tar"))
    return keys, payload


def _wait_line(proc: subprocess.Popen, pattern: str, timeout: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline() if proc.stderr else ""
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r}; got: {''.join(seen)[-2000:]}")


def _listening(lab: NetLab, host: str) -> list[str]:
    """Local addresses of TCP listeners in ``host`` (``ss -ltn``)."""
    out = lab.run(host, ["ss", "-Hltn"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


@pytest.fixture
def job(request, tmp_path):
    """The lab (2 nodes, or ``request.param``) with storage and a cache server per node running."""
    data = tmp_path / "data" / "ds"
    keys, payload = _write_dataset(data)
    password_file = tmp_path / "cache.password"
    ensure_secret_file(password_file)
    with NetLab(nodes=getattr(request, "param", 2)) as lab:
        st = lab.storage.address
        storage = lab.popen(
            "storage",
            [sys.executable, str(HERE / "storage_server.py"), str(tmp_path / "data"), st, str(HTTP_PORT)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert storage.stdout.readline().strip() == "ready"
        lab.relay("storage", RELAY_PORT, to=(st, HTTP_PORT), one_way_delay_s=DELAY_S)
        caches = {}
        for node in lab.nodes:
            serve = lab.popen(
                node,
                [
                    sys.executable,
                    "-m",
                    "stallfree",
                    "cache",
                    "serve",
                    "--bind",
                    node.address,
                    "--port",
                    str(CACHE_PORT),
                    "--capacity",
                    "64MB",
                    "--password-file",
                    str(password_file),
                    "--dir",
                    str(tmp_path / f"cache-{node.name}"),
                ],  # fmt: skip
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            _wait_line(serve, r"serving minio cache")
            caches[node.name] = serve
        yield {
            "lab": lab,
            "keys": keys,
            "payload": payload,
            "password_file": password_file,
            "caches": caches,
            "data_url": f"http://{st}:{RELAY_PORT}/ds",
            "stats_url": f"http://{st}:{HTTP_PORT + 1}/",
            "cache_urls": [f"redis://{n.address}:{CACHE_PORT}" for n in lab.nodes],
        }


def _launch(
    job: dict, out: Path, epochs: int, kill_at_epoch: int = -1, nodes: int | None = None, extra: tuple = ()
) -> list[subprocess.Popen]:
    lab: NetLab = job["lab"]
    hosts = lab.nodes[: nodes or len(lab.nodes)]
    rdzv = f"{hosts[0].address}:{RDZV_PORT}"
    procs = []
    for node in hosts:
        argv = [
            str(TORCHRUN), "--nnodes", str(len(hosts)), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "netlab-job",
            "--local-addr", node.address, "--max-restarts", "0",
            # the store's host is told, not guessed: torchrun would compare the endpoint with
            # the addresses the hostname resolves to, which are the root namespace's
            "--rdzv-conf", f"is_host={int(node is hosts[0])}",
            str(HERE / "multinode_train.py"),
            "--data", job["data_url"], "--stats-url", job["stats_url"],
            "--cache", *job["cache_urls"], "--password-file", str(job["password_file"]),
            "--epochs", str(epochs), "--kill-at-epoch", str(kill_at_epoch), "--out", str(out), *extra,
        ]  # fmt: skip
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "GLOO_SOCKET_IFNAME": "eth0",  # gloo binds the node's own interface, not the hostname's
            "OMP_NUM_THREADS": "1",
        }
        log = open(out / f"{node.name}.log", "w")  # noqa: SIM115 - closed when the test ends
        procs.append(lab.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    return procs


def _wait(procs: list[subprocess.Popen], out: Path, timeout: float, on_kill=None, expect_rc: int = 0) -> None:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if on_kill is not None and (out / "kill").exists() and not (out / "killed").exists():
            on_kill()
            (out / "killed").write_text("done")
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            logs = "\n".join(p.read_text()[-3000:] for p in out.glob("node*.log"))
            raise AssertionError(f"the job did not finish within {timeout}s:\n{logs}")
        time.sleep(0.1)
    logs = {p.name: p.read_text() for p in out.glob("node*.log")}
    expected = [expect_rc] * len(procs)
    assert [p.returncode for p in procs] == expected, "\n".join(v[-3000:] for v in logs.values())
    if expect_rc != 0:  # the job was stopped on purpose: torchrun reports its dead children
        return
    for text in logs.values():  # a dead cache node is a few warnings, never a traceback storm
        assert not _our_tracebacks(text), text[-3000:]
        assert text.count("unusable") <= 10, text[-3000:]


def _our_tracebacks(log: str) -> list[str]:
    """Tracebacks through stallfree's code (torchrun's agent may log its own at shutdown when the
    rendezvous host has already gone: not ours to judge)."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    return [b[:3000] for b in blocks if "/stallfree/" in b.split("\n\n")[0] or "multinode_train" in b[:3000]]


def _records(out: Path, world: int = 2) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_two_nodes_read_storage_once_and_share_one_cluster_cache(job, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lab: NetLab = job["lab"]
    procs = _launch(job, out, epochs=3, kill_at_epoch=2)

    def kill_node1_cache() -> None:
        job["caches"]["node1"].kill()  # SIGKILL `cache serve`; its redis-server dies with it

    listeners = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not listeners.get("node1"):
        listeners = {n.name: _listening(lab, n.name) for n in lab.nodes}
        time.sleep(0.2)
    _wait(procs, out, timeout=240, on_kill=kill_node1_cache)

    records = _records(out)
    assert {r["world"] for r in records} == {2}
    for epoch in range(3):
        got = [k for r in records for k in r["epochs"][epoch]]
        assert len(got) == len(set(got)) == SAMPLES, f"epoch {epoch}: a sample lost or repeated"
        assert set(got) == job["keys"]
    cold, warm, after_kill = np.diff([0, *records[0]["storage_bytes"]])
    payload = job["payload"]
    print(
        f"storage bytes per epoch / data: {cold / payload:.3f} {warm / payload:.3f} {after_kill / payload:.3f}"
    )
    assert payload * 0.9 <= cold <= payload * 1.2, (cold, payload)  # ~1x the data, read once
    assert warm < 0.05 * payload, (warm, payload)  # served by the cluster tier
    # node1's half of the cache is gone: epoch 3 re-reads what of that half was not delivered
    # before the kill (how much that is depends on how far ahead the ranks were), never more
    assert 0 < after_kill <= 0.6 * payload, (after_kill, payload)
    for node in lab.nodes:  # each cache server listens on its node's address, never a wildcard
        cache_listeners = [a for a in listeners[node.name] if a.endswith(f":{CACHE_PORT}")]
        assert cache_listeners == [f"{node.address}:{CACHE_PORT}"], listeners[node.name]


@pytest.mark.slow
def test_a_job_killed_mid_epoch_resumes_exactly_on_fewer_nodes(job, tmp_path):
    """2 nodes stop after batch 3 of epoch 1 (as a preempted job dies); the same state resumes on
    1 node: epoch 1 is completed with every sample exactly once, and epoch 2 runs whole."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    _wait(_launch(job, first, epochs=3, extra=("--stop-at", "1", "3")), first, timeout=240, expect_rc=1)
    state = first / "state.json"
    assert json.loads(state.read_text())["epoch"] == 1
    before = [k for r in _records(first) for k in r["epochs"][1]]  # epoch 1 up to the stop
    assert len(before) == 2 * 4 * 8
    _wait(_launch(job, second, epochs=3, nodes=1, extra=("--resume", str(state))), second, timeout=240)
    (resumed,) = _records(second, world=1)
    assert resumed["world"] == 1
    epoch1 = before + resumed["epochs"][0]
    assert len(epoch1) == len(set(epoch1)) == SAMPLES and set(epoch1) == job["keys"]
    assert sorted(resumed["epochs"][1]) == sorted(job["keys"])


@pytest.mark.slow
@pytest.mark.parametrize("job", [3], indirect=True)
def test_three_nodes_of_one_rank_each_share_the_cluster_cache(job, tmp_path):
    """More nodes than the pair of the tests above (3: the fewest that are more): the rendezvous
    and the cluster cache span all of them; 192 samples are 8 batches of 8 a rank."""
    out = tmp_path / "out"
    out.mkdir()
    _wait(_launch(job, out, epochs=2), out, timeout=300)
    records = _records(out, world=3)
    for epoch in range(2):
        got = [k for r in records for k in r["epochs"][epoch]]
        assert len(got) == len(set(got)) == SAMPLES and set(got) == job["keys"]
    cold, warm = np.diff([0, *records[0]["storage_bytes"]])
    print(f"3 nodes: storage bytes per epoch / data: {cold / job['payload']:.3f} {warm / job['payload']:.3f}")
    assert job["payload"] * 0.9 <= cold <= job["payload"] * 1.2
    assert warm < 0.05 * job["payload"]


@pytest.mark.slow
def test_a_cache_node_partitioned_mid_epoch_then_healed(job, tmp_path):
    """Node 1's cache server becomes unreachable (100% loss on its flows; node 1 itself stays up)
    after batch 1 of epoch 2 and heals 3 s later: every epoch still delivers each sample exactly
    once, and epoch 4 is served from the cluster again (the tier came back)."""
    lab: NetLab = job["lab"]
    node1 = lab.nodes[1]
    relay = lab.relay(node1, CACHE_PORT + 10, to=(node1.address, CACHE_PORT), one_way_delay_s=0.0)
    urls = [job["cache_urls"][0], f"redis://{node1.address}:{CACHE_PORT + 10}"]
    out = tmp_path / "out"
    out.mkdir()
    healer: list[threading.Timer] = []

    def partition() -> None:
        lab.cut(relay)
        healer.append(threading.Timer(3.0, lab.mend, args=(relay,)))
        healer[0].start()

    procs = _launch({**job, "cache_urls": urls}, out, epochs=4, kill_at_epoch=2)
    try:
        _wait(procs, out, timeout=240, on_kill=partition)
    finally:
        for t in healer:
            t.join()
    records = _records(out)
    for epoch in range(4):
        got = [k for r in records for k in r["epochs"][epoch]]
        assert len(got) == len(set(got)) == SAMPLES and set(got) == job["keys"], f"epoch {epoch}"
    cold, warm, cut, healed = np.diff([0, *records[0]["storage_bytes"]])
    payload = job["payload"]
    print(
        f"partition: storage bytes per epoch / data: {cold / payload:.3f} {warm / payload:.3f} {cut / payload:.3f} {healed / payload:.3f}"
    )
    assert warm < 0.05 * payload
    assert cut <= 0.6 * payload  # at most node 1's share re-read while it was cut off
    assert healed < 0.05 * payload  # node 1's cache is used again after the heal
