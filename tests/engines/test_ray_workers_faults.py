"""RayWorkers' fault paths on a real loopback Ray cluster, each run in a subprocess with a timeout
(a hang fails the test, not the suite); one cluster for all of them, started by that subprocess.

- a remote batch past its deadline is sent to a second worker; the first result is kept, the
  epoch is exactly once;
- a remote worker slow but steady (never past its deadline) is passed over once its pace is
  known: it delivers only the batches it was given before that, the epoch in the local order,
  exactly once;
- every remote worker killed mid-epoch: ``on_lost="raise"`` ends the epoch with
  ``RemoteWorkersLost``; by default the loader goes on with its local workers, one warning,
  nothing lost or repeated;
- a remote node's raylet SIGKILLed mid-epoch: its batches run on the other node's worker,
  nothing lost or repeated.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, logging, os, sys, time

from stallfree.testing.ray_cluster import start_loopback_cluster

import ray
import torch
from torch.utils.data import Dataset

from stallfree import DataLoader, RayWorkers
from stallfree.engines.ray_pool import RemoteWorkersLost

N, BATCH = 120, 4
warnings = []


class Catch(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())


logging.getLogger("stallfree.engines").addHandler(Catch())


class Slow(Dataset):
    # each sample takes a little time, so an epoch lasts long enough to fault it mid-way;
    # on the worker named ``slow_wid`` each sample takes much longer (a straggler)
    def __init__(self, slow_wid=None, delay=0.004, slow_delay=0.1):
        self.slow_wid = slow_wid
        self.delay = delay
        self.slow_delay = slow_delay

    def __len__(self):
        return N

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        time.sleep(self.slow_delay if info is not None and info.id == self.slow_wid else self.delay)
        return {"i": i}


def epoch(loader, fault_after=None, fault=None):
    got, error = [], None
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except RemoteWorkersLost as exc:
            error = str(exc)
            break
        got += batch["i"].tolist()
        if fault_after is not None and len(got) // BATCH == fault_after:
            fault()
    return got, error


out = {}
cluster = start_loopback_cluster(
    worker_nodes=2, cpus_per_node=1, system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 3}
)
res = {"stallfree_cpu": 1}

# 1. a straggler: worker 1 (the first remote one; num_workers=0 has the main thread as worker 0)
# (0.4 s a batch there, 0.08 s on the other: a re-issued copy wins, and the straggler's own copy
# comes back while the epoch still runs, to be dropped)
remote = RayWorkers(2, resources=res, reissue_after_s=0.2)
loader = DataLoader(Slow(slow_wid=1, delay=0.02), batch_size=BATCH, shuffle=True, seed=1, remote=remote)
got, _ = epoch(loader)
out["straggler"] = {"got": got, "stats": loader.stats()["remote"]}
loader.close()

# 1b. the only remote worker is the straggler (worker 1, beside one local worker 0): its late
# batches get a copy on the local worker; the first result is delivered, the other dropped
remote = RayWorkers(1, resources=res, reissue_after_s=0.2)
loader = DataLoader(Slow(slow_wid=1, delay=0.02), batch_size=BATCH, shuffle=True, seed=5, num_workers=1, remote=remote)
got, _ = epoch(loader)
out["straggler_alone"] = {"got": got, "stats": loader.stats()["remote"]}
loader.close()

# 1c. the only remote worker is slow but steady (1.2 s a batch there, 0.04 s on the local worker:
# never past its deadline of four times its own median): once its pace is known it is sent no
# more than a probe now and then, so it cannot hold up the head of the in-order window
remote = RayWorkers(1, resources=res)
loader = DataLoader(
    Slow(slow_wid=1, delay=0.01, slow_delay=0.3), batch_size=BATCH, shuffle=True, seed=6, num_workers=1, remote=remote
)
got, _ = epoch(loader)
plain = DataLoader(Slow(delay=0), batch_size=BATCH, shuffle=True, seed=6)
want = [i for batch in plain for i in batch["i"].tolist()]
out["steady_slow"] = {"got": got, "want": want, "stats": loader.stats()["remote"]}
loader.close()

# 2. every remote worker killed mid-epoch, on_lost="raise"
remote = RayWorkers(1, resources=res, on_lost="raise")
loader = DataLoader(Slow(), batch_size=BATCH, shuffle=True, seed=2, num_workers=1, remote=remote)
got, error = epoch(loader, 3, lambda: [ray.kill(a) for a in remote._actors])
out["raise"] = {"got": got, "error": error}
loader.close()

# 3. the same with the default: the local worker goes on, one warning
warnings.clear()
remote = RayWorkers(1, resources=res)
loader = DataLoader(Slow(), batch_size=BATCH, shuffle=True, seed=3, num_workers=1, remote=remote)
got, error = epoch(loader, 3, lambda: [ray.kill(a) for a in remote._actors])
out["fallback"] = {"got": got, "error": error, "stats": loader.stats()["remote"], "warnings": list(warnings)}
loader.close()

# 4. a node's raylet SIGKILLed mid-epoch: its worker's batches run on the other node (slower
# samples: the epoch outlasts Ray's noticing, ~2 s with the health checks above)
victim = cluster.worker_nodes[0]
remote = RayWorkers(2, resources=res)
loader = DataLoader(Slow(delay=0.04), batch_size=BATCH, shuffle=True, seed=4, remote=remote)
got, error = epoch(loader, 2, lambda: cluster.kill_raylet(victim))
out["node"] = {"got": got, "error": error, "stats": loader.stats()["remote"]}
loader.close()
cluster.shutdown()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    pytest.importorskip("ray")
    cwd: Path = tmp_path_factory.mktemp("ray_faults")
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=420, cwd=cwd
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_a_straggler_batch_is_reissued_and_delivered_once(outcome):
    got, stats = outcome["straggler"]["got"], outcome["straggler"]["stats"]
    assert sorted(got) == list(range(120))
    assert stats["reissued"] >= 1
    assert stats["duplicates_dropped"] >= 1  # the straggler's late copies, never delivered
    assert stats["batches_remote"] == 30  # each batch delivered once, whichever copy came first


def test_the_only_remote_worker_late_gets_a_local_copy_delivered_once(outcome):
    got, stats = outcome["straggler_alone"]["got"], outcome["straggler_alone"]["stats"]
    assert sorted(got) == list(range(120))  # nothing twice: a copy's twin is dropped
    assert stats["reissued"] >= 1
    assert stats["duplicates_dropped"] >= 1


def test_a_slow_steady_remote_worker_is_passed_over_once_its_pace_is_known(outcome):
    r = outcome["steady_slow"]
    got, stats = r["got"], r["stats"]
    assert got == r["want"]  # the local loader's order, every sample once
    assert stats["reissued"] == 0  # slow, never late: the deadline rule alone would keep it
    assert stats["batches_remote"] + stats["batches_local"] == 30
    # only its two credits' worth, sent before its pace was known (a probe is a copy of a local
    # batch, delivered only if it wins); before the dispatch rule it was sent one whenever it
    # had room (8 of the 30 in a run)
    assert stats["batches_remote"] <= 2, stats
    assert stats["passed_over"] > 0


def test_all_remote_workers_gone_raises_when_told(outcome):
    r = outcome["raise"]
    assert r["error"] is not None and r["error"].startswith(
        "every remote worker is gone (1 on ['127.0.0.1'])"
    )
    assert len(r["got"]) == len(set(r["got"]))


def test_all_remote_workers_gone_goes_on_locally_with_one_warning(outcome):
    r = outcome["fallback"]
    assert r["error"] is None
    assert sorted(r["got"]) == list(range(120))  # nothing lost, nothing twice
    assert r["stats"]["workers_lost"] == 1
    lost = [w for w in r["warnings"] if w.startswith("every remote worker is gone")]
    assert len(lost) == 1, r["warnings"]
    assert "goes on with its local workers" in lost[0]


def test_a_killed_node_loses_nothing_and_repeats_nothing(outcome):
    r = outcome["node"]
    assert r["error"] is None
    assert sorted(r["got"]) == list(range(120))
    assert r["stats"]["workers_lost"] == 1
    alive = [w["alive"] for w in r["stats"]["workers"].values()]
    assert sorted(alive) == [False, True]
