"""examples/train_nanogpt_schedule.py on CPU with tiny data: two DDP processes on a three-stage
mixture, killed after a checkpoint, resumed on one process past a stage boundary with two steps
skipped; then ``stallfree trace`` of steps before and after the resume names exactly what each
rank trained on (its own log of documents), and ``stallfree audit`` finds every sample once."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stallfree.cli import main
from tests.zygote import AS_SCRIPT, run_python

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, script: Path, args: list[str], log) -> subprocess.Popen:
    cmd = [
        str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), str(script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _stallfree(capsys, *args: str) -> tuple[int, str]:
    """``stallfree ARGS`` in this process (each subprocess would import torch again): exit code, stdout."""
    code = main(list(args))
    return code, capsys.readouterr().out


def _logged(prefix: Path, rank: int) -> dict[int, list]:
    """The last entry per step: after the kill, a resumed run's steps replace the killed run's."""
    path = Path(f"{prefix}.{rank}")
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["samples"] for r in rows}


@pytest.mark.slow
def test_kill_resume_on_one_process_skip_and_trace(tmp_path, capsys, monkeypatch):
    if not TORCHRUN.exists():
        pytest.skip("torchrun not installed beside this Python")
    data, out, keys = tmp_path / "data", tmp_path / "run", tmp_path / "keys"
    example = ROOT / "examples" / "train_nanogpt_schedule.py"
    # the example's own --make-data, forked from the test zygote (tests/zygote.py: torch imported once)
    made = run_python(AS_SCRIPT, str(example), "--make-data", str(data), timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    common = [
        "--data",
        str(data),
        "--out",
        str(out),
        "--ckpt-every",
        "4",
        "--workers",
        "1",
        "--record-keys",
        str(keys),
    ]
    # run 1: two ranks (8 samples each a step); rank 0 is SIGKILLed right after the step-8 checkpoint
    with open(tmp_path / "run1.log", "wb") as log:
        proc = _torchrun(
            2, ROOT / "tests/examples/nanogpt_preempted.py",
            [*common, "--steps", "30", "--kill-at", "8", "--log-batches", str(tmp_path / "first")], log,
        )  # fmt: skip
        try:
            proc.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    state = json.loads((out / "ckpt" / "loader.json").read_text())
    assert state["step"] == 8 and state["consumed"] == 128, (tmp_path / "run1.log").read_text()
    # run 2: one process, the same command, two steps skipped; it crosses the stage boundary at 480
    with open(tmp_path / "run2.log", "wb") as log:
        args = [*common, "--steps", "64", "--skip-steps", "20:22", "--log-batches", str(tmp_path / "second")]
        args += ["--workers", "0"]
        proc = _torchrun(1, example, args, log)
        assert proc.wait(timeout=600) == 0, (tmp_path / "run2.log").read_text()
    final = json.loads((out / "ckpt" / "loader.json").read_text())
    assert final["step"] == 64 and [h["world_size"] for h in final["history"]] == [2, 1]
    assert final["skips"][0]["steps"] == [20, 22]
    # the trace of steps before and after the resume, from the final checkpoint alone
    state_file = str(out / "ckpt" / "loader.json")
    dataset = ["--dataset", "examples.train_nanogpt_schedule:mixture", "--dataset-arg", str(data)]
    checks = [(5, 1, _logged(tmp_path / "first", 1)), (7, 0, _logged(tmp_path / "first", 0))]
    checks += [(s, 0, _logged(tmp_path / "second", 0)) for s in (8, 20, 63)]
    monkeypatch.chdir(ROOT)  # --dataset examples.train_nanogpt_schedule:... from the repo's root
    for step, rank, logged in checks:
        code, got = _stallfree(
            capsys, "trace", state_file, "--step", str(step), "--rank", str(rank), *dataset, "--json"
        )
        assert code == 0
        traced = json.loads(got)
        assert traced["world_size"] == (2 if step < 8 else 1)
        named = [[s["source"], [d["doc"] for d in s["documents"]]] for s in traced["samples"]]
        assert named == logged[step], step
    losses = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    stages = {json.dumps(r["target"], sort_keys=True) for r in losses}
    assert len(stages) == 2  # 128 + 32 skipped + 56 * 8 positions: the warm-up stage, then the second
    code, audited = _stallfree(capsys, "audit", str(keys), "--json")
    report = json.loads(audited)
    assert code == 0 and report["ok"], audited
    assert report["epochs"]["0"]["skipped"] == 32 and report["epochs"]["0"]["duplicates"] == 0
