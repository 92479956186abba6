"""`stallfree bench` across nodes, by the documented torchrun recipe: one `torchrun -m stallfree bench`
per node (c10d rendezvous on node0), storage in its own namespace; rank 0 reports every rank,
labelled with its node, and the JSON has one summary per rank."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stallfree
from stallfree.testing.images import jpeg_bytes
from stallfree.testing.netlab import NetLab, unavailable_reason

REASON = unavailable_reason()
TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}"),
    pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed beside this Python"),
]
HERE = Path(__file__).parent
REPO = HERE.parent.parent


@pytest.mark.slow
def test_bench_under_torchrun_reports_every_rank_of_every_node(tmp_path):
    data = tmp_path / "data" / "ds"
    with stallfree.ShardWriter(str(data), format="tar", max_samples=16) as w:
        for i, jpg in enumerate(jpeg_bytes(64, sizes=((96, 72), (72, 96)))):
            w.write({"__key__": f"{i:04d}", "jpg": jpg, "cls": i % 4})
    with NetLab(nodes=2) as lab:
        st = lab.storage.address
        storage = lab.popen(
            "storage",
            [sys.executable, str(HERE / "storage_server.py"), str(data.parent), st, "7200"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert storage.stdout.readline().strip() == "ready"
        procs = []
        for i, node in enumerate(lab.nodes):
            argv = [
                str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{lab.nodes[0].address}:29410", "--rdzv-id", "bench-nodes",
                "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", node.address, "--max-restarts", "0",
                "-m", "stallfree", "bench", f"http://{st}:7200/ds", "--loader", "stallfree",
                "--steps", "6", "--warmup", "1", "--batch-size", "4", "--workers", "1", "--image-size", "16",
                "--step-ms", "1", "--json", str(tmp_path / f"bench-{node.name}.json"),
            ]  # fmt: skip
            env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "eth0"}
            procs.append(
                lab.popen(
                    node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
                )
            )
        deadline = time.monotonic() + 240
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                p.kill()
                raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    table = outputs[0]
    assert "0@node0" in table and "1@node1" in table, table[-3000:]
    report = json.loads((tmp_path / "bench-node0.json").read_text())
    ranks = report["loaders"]["stallfree"]["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert not (tmp_path / "bench-node1.json").exists()  # rank 0 reports for the job
