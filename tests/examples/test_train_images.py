"""examples/train_images.py on CPU with tiny data: two DDP processes (torchrun, gloo, loopback
rendezvous) killed after a checkpoint, resumed with one process; every sample of the epoch is
trained on exactly once, counting only what the checkpoint covers from the killed run."""

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.shards.writer import ShardWriter
from stallfree.testing.images import jpeg_bytes

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
N, BATCH = 48, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc, args, log, script="train_images.py", env=None):
    cmd = [
        str(TORCHRUN),
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(ROOT / ("examples" if script == "train_images.py" else "tests/examples") / script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _steps(prefix: Path, rank: int) -> list[dict]:
    path = Path(f"{prefix}.{rank}")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_kill_and_resume_on_fewer_ranks(tmp_path):
    if not TORCHRUN.exists():
        pytest.skip("torchrun not installed beside this Python")
    data = tmp_path / "data"
    images = jpeg_bytes(N, sizes=((48, 40), (40, 56)))
    with ShardWriter(str(data), format="tar", max_samples=10, classes=["a", "b", "c"]) as w:
        for i in range(N):
            w.write({"__key__": f"img{i:03d}", "jpg": images[i], "cls": i % 3})
    ckpt, keys, keys2 = tmp_path / "ckpt.pt", tmp_path / "keys", tmp_path / "keys2"
    args = [
        "--data",
        str(data),
        "--ckpt",
        str(ckpt),
        "--batch-size",
        str(BATCH),
        "--size",
        "32",
        "--workers",
        "0",
        "--ckpt-every",
        "2",
    ]
    # run 1: two ranks; rank 0 is SIGKILLed right after the step-4 checkpoint, two steps before
    # the end of the epoch (48 samples / (2 ranks * 4) = 6 steps), and torchrun stops rank 1
    with open(tmp_path / "run1.log", "wb") as log:
        proc = _torchrun(
            2, [*args, "--log-keys", str(keys)], log, "preempted_train.py", {"STALLFREE_TEST_KILL_AT": "4"}
        )
        try:
            proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        assert "Signal 9 (SIGKILL) received" in (tmp_path / "run1.log").read_text()
    import torch

    saved = torch.load(ckpt, weights_only=True)["step"]
    assert saved == 4, (tmp_path / "run1.log").read_text()
    seen = [k for r in (0, 1) for s in _steps(keys, r) if s["step"] <= saved for k in s["keys"]]
    assert len(seen) == saved * BATCH * 2
    # run 2: one rank, same command: goes on from the checkpoint to the end of the epoch
    with open(tmp_path / "run2.log", "wb") as log:
        proc = _torchrun(1, [*args, "--log-keys", str(keys2)], log)
        assert proc.wait(timeout=600) == 0, (tmp_path / "run2.log").read_text()
    resumed = _steps(keys2, 0)
    assert [s["step"] for s in resumed] == list(range(saved + 1, saved + 1 + (N - len(seen)) // BATCH))
    total = collections.Counter(seen + [k for s in resumed for k in s["keys"]])
    assert total == collections.Counter(f"img{i:03d}" for i in range(N))
