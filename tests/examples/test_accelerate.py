"""examples/train_accelerate.py on CPU with tiny image shards: our Accelerator on two processes
(torchrun, gloo, loopback rendezvous), killed after a checkpoint mid-epoch, resumed on two
processes, killed again in the second epoch, resumed on one, all through ``prepare`` and
``save_state`` / ``load_state`` alone. Every image is trained on exactly once per epoch, counting
only what each checkpoint covers of a killed run; the checkpoints hold the loader's state as JSON
and no pickled copy of it."""

from __future__ import annotations

import collections
import json

import pytest

from stallfree.shards.writer import ShardWriter
from stallfree.testing.images import jpeg_bytes
from tests.examples.test_hf_trainer import TORCHRUN, run_torchrun, steps_of

N, BATCH, EPOCHS, EVERY = 48, 4, 2, 3  # 2 ranks: 6 steps an epoch, checkpoints every 3


@pytest.mark.slow
def test_killed_and_resumed_on_two_then_one_process_trains_every_image_once_per_epoch(tmp_path):
    if not TORCHRUN.exists():
        pytest.skip("torchrun not installed beside this Python")
    pytest.importorskip("accelerate")
    data = tmp_path / "data"
    images = jpeg_bytes(N, sizes=((48, 40), (40, 56)))
    with ShardWriter(str(data), format="tar", max_samples=10, classes=["a", "b", "c"]) as w:
        for i in range(N):
            w.write({"__key__": f"img{i:03d}", "jpg": images[i], "cls": i % 3})
    ckpt = tmp_path / "ckpt"
    common = [
        "--data", str(data), "--ckpt-dir", str(ckpt), "--batch-size", str(BATCH), "--size", "32",
        "--workers", "1", "--epochs", str(EPOCHS), "--ckpt-every", str(EVERY),
    ]  # fmt: skip
    trained: list[str] = []
    for i, (nproc, kill_at) in enumerate([(2, 3), (2, 9), (1, None)]):
        prefix = tmp_path / f"keys{i}"
        script = "tests/examples/accelerate_preempted.py" if kill_at else "examples/train_accelerate.py"
        extra = ["--log-keys", str(prefix), *(["--kill-at", str(kill_at)] if kill_at else [])]
        log = run_torchrun(
            nproc, script, [*common, *extra], tmp_path / f"run{i}.log", expect_kill=bool(kill_at)
        )
        if kill_at is None:
            assert "decode in workers" in log, log[-3000:]  # decode= survived prepare
        trained += [
            k for s in steps_of(prefix, nproc) if kill_at is None or s["step"] <= kill_at for k in s["keys"]
        ]
    assert collections.Counter(trained) == collections.Counter({f"img{i:03d}": EPOCHS for i in range(N)})
    step9 = ckpt / "step_9"
    saved = json.loads((step9 / "stallfree_loader_state.json").read_text())
    assert saved["world_size"] == 2
    assert {k: saved["loaders"][0][k] for k in ("epoch", "consumed", "dataset_len")} == {
        "epoch": 1,
        "consumed": 24,
        "dataset_len": N,
    }
    assert not list(step9.glob("custom_checkpoint_*"))  # no pickled register_for_checkpointing copy
