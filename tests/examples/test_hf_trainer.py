"""examples/train_hf_trainer.py on CPU with tiny data: transformers' Trainer (our subclass) on two
DDP processes (torchrun, gloo, loopback rendezvous), killed after a checkpoint mid-epoch, resumed
on two processes, killed again in the second epoch, resumed on one. Every window is trained on
exactly once per epoch, counting only what each checkpoint covers of a killed run."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
WINDOWS, SEQ, BATCH, EPOCHS, SAVE = 48, 16, 4, 2, 3  # 2 ranks: 6 steps an epoch, checkpoints every 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(nproc: int, script: str, args: list[str], log_path: Path, *, expect_kill: bool) -> str:
    """``torchrun`` ``script`` (a path from the repository root) on ``nproc`` local processes;
    its output, after checking it ended as expected (rank 0 SIGKILLed itself, or success)."""
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
        str(ROOT / script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=400)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    text = log_path.read_text(errors="replace")
    if expect_kill:
        assert "Signal 9 (SIGKILL) received" in text, text[-4000:]
    else:
        assert rc == 0, text[-4000:]
    return text


def steps_of(prefix: Path, ranks: int) -> list[dict]:
    """The JSON lines every rank's training steps appended to ``PREFIX.RANK``."""
    out = []
    for rank in range(ranks):
        path = Path(f"{prefix}.{rank}")
        out += [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return out


def trainer_run(tmp_path: Path, *, plain: bool = False) -> collections.Counter:
    """Windows trained on over 2 epochs across three runs: 2 processes (killed at step 3), 2
    processes (killed at step 9, in epoch 2), 1 process to the end; the killed runs counted up to
    their last checkpoint."""
    tokens = tmp_path / "tokens.bin"
    np.arange(WINDOWS * SEQ + 1, dtype=np.uint16).tofile(tokens)
    out = tmp_path / "out"
    common = [
        "--data", str(tokens), "--dtype", "uint16", "--out", str(out), "--seq-len", str(SEQ),
        "--vocab-size", "1024", "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
        "--save-steps", str(SAVE), "--workers", "1",
        *(["--plain"] if plain else []),
    ]  # fmt: skip
    trained: list[int] = []
    for i, (nproc, kill_at) in enumerate([(2, 3), (2, 9), (1, None)]):
        prefix = tmp_path / f"windows{i}"
        extra = ["--log-windows", str(prefix), *(["--kill-at", str(kill_at)] if kill_at else [])]
        script = "tests/examples/hf_trainer_run.py"
        run_torchrun(
            nproc, script, [*common, *extra], tmp_path / f"run{i}.log", expect_kill=kill_at is not None
        )
        trained += [
            w
            for s in steps_of(prefix, nproc)
            if kill_at is None or s["step"] <= kill_at
            for w in s["windows"]
        ]
    return collections.Counter(trained)


@pytest.mark.slow
def test_killed_and_resumed_on_two_then_one_process_trains_every_window_once_per_epoch(tmp_path):
    if not TORCHRUN.exists():
        pytest.skip("torchrun not installed beside this Python")
    pytest.importorskip("transformers")
    trained = trainer_run(tmp_path)
    assert trained == collections.Counter({w: EPOCHS for w in range(WINDOWS)})
    saved = json.loads((tmp_path / "out" / "checkpoint-9" / "stallfree_loader_state.json").read_text())
    # step 9 on 2 ranks: epoch 1 (the second), 3 steps of 2 x 4 windows into it
    assert (saved["step"], saved["world_size"]) == (9, 2)
    assert {k: saved["loaders"][0][k] for k in ("epoch", "consumed", "dataset_len")} == {
        "epoch": 1,
        "consumed": 24,
        "dataset_len": WINDOWS,
    }
