"""examples/lightning_datamodule.py on CPU with its own tiny data: run 1 stops after some steps
(Lightning's max_steps, or SIGKILL once a checkpoint is on disk), run 2 is the same command and
resumes from Lightning's last.ckpt through the DataModule's state_dict hooks; over the two runs
every sample of both epochs is trained on exactly once, counting only what the checkpoint covers
from run 1.

The runs fork from a test zygote that imported torch, stallfree and Lightning once
(``tests/zygote.py``): the point here is the resume, not a fresh interpreter's start."""

import collections
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from tests.zygote import AS_SCRIPT, Child, start_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_datamodule.py"
TRAIN, BATCH, EPOCHS, EVERY = 96, 4, 2, 5  # the example's tiny data has 96 training samples
STEPS = TRAIN // BATCH  # per epoch

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None,
        reason="lightning is not installed: pip install -r examples/requirements.txt (scripts/setup.sh does)",
    ),
    # both runs of both tests fork from one xdist worker's Lightning zygote (one import, not two)
    pytest.mark.xdist_group("lightning_zygote"),
]


def _run(tmp_path: Path, extra: list[str]) -> Child:
    """``python EXAMPLE --ckpt-dir ... EXTRA`` (forked from the Lightning zygote)."""
    args = [str(EXAMPLE), "--ckpt-dir", str(tmp_path / "ckpt"), "--size", "32"]
    args += ["--workers", "0", "--batch-size", str(BATCH), "--epochs", str(EPOCHS)]
    args += ["--ckpt-every", str(EVERY), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return start_python(AS_SCRIPT, *args, cwd=tmp_path, env=env, preload=("lightning",))


def _finish(proc: Child, timeout: float) -> tuple[int | None, str]:
    """Its exit code (None: still running after ``timeout`` s, then killed) and its output."""
    rc = proc.wait(timeout)
    if rc is None:
        proc.kill_session()
    out, err = proc.output()
    return rc, out + err


def _steps(path: Path) -> list[dict]:
    """The complete lines of a key log (a killed run may leave a partial last one)."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["max_steps", "kill"])
def test_stop_and_resume_sees_every_sample_once(tmp_path, stop):
    keys1, keys2, last = tmp_path / "keys1", tmp_path / "keys2", tmp_path / "ckpt" / "last.ckpt"
    if stop == "max_steps":  # a clean stop two steps past the step-5 checkpoint
        rc, log = _finish(_run(tmp_path, ["--max-steps", str(EVERY + 2), "--log-keys", str(keys1)]), 600)
        assert rc == 0, log
    else:  # SIGKILL once step EVERY + 1 has begun: the step-5 checkpoint was written before it
        proc = _run(tmp_path, ["--log-keys", str(keys1)])
        deadline, rc = time.monotonic() + 600, None
        try:
            while len(_steps(Path(f"{keys1}.0"))) <= EVERY and rc is None and time.monotonic() < deadline:
                time.sleep(0.05)
                rc = proc.wait(0)
        finally:
            proc.kill_session()  # SIGKILL
            out, err = proc.output()
        # not ended on its own, nor out of time, before it was past its first checkpoint
        assert len(_steps(Path(f"{keys1}.0"))) > EVERY, (rc, out + err)
    import torch

    ckpt = torch.load(last, weights_only=False)  # Lightning's own checkpoint, written by this test's run
    saved = ckpt["global_step"]  # 5 unless the killed run got further before the kill landed
    assert saved >= EVERY and saved % EVERY == 0 and saved < EPOCHS * STEPS
    loader_state = ckpt["StallfreeDataModule"]["train_loader"]  # the batches trained on, none ahead
    assert (loader_state["epoch"], loader_state["consumed"]) == (
        (saved - 1) // STEPS,
        ((saved - 1) % STEPS + 1) * BATCH,
    )
    run1 = [s for s in _steps(Path(f"{keys1}.0")) if s["step"] <= saved]
    assert [s["step"] for s in run1] == list(range(1, saved + 1))

    rc, log = _finish(_run(tmp_path, ["--log-keys", str(keys2)]), 600)  # the same command resumes
    assert rc == 0, log
    run2 = _steps(Path(f"{keys2}.0"))
    assert [s["step"] for s in run2] == list(range(saved + 1, EPOCHS * STEPS + 1))
    expected = collections.Counter(f"img{i:04d}" for i in range(TRAIN))
    for epoch in range(EPOCHS):
        seen = collections.Counter(k for s in run1 + run2 if s["epoch"] == epoch for k in s["keys"])
        assert seen == expected, f"epoch {epoch}"
