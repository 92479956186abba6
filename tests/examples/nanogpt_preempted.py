"""examples/train_nanogpt_schedule.py, preempted: once rank 0 has written the checkpoint of step
``--kill-at`` it SIGKILLs itself, as a lost node would; torchrun then stops the other rank."""

import importlib.util
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    i = sys.argv.index("--kill-at")
    kill_at = int(sys.argv[i + 1])
    del sys.argv[i : i + 2]
    spec = importlib.util.spec_from_file_location(
        "train_nanogpt_schedule", ROOT / "examples" / "train_nanogpt_schedule.py"
    )
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    save = train.save

    def save_then_preempt(out, model, optim, loader, step):
        save(out, model, optim, loader, step)
        if step == kill_at and train.dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    train.save = save_then_preempt
    sys.argv[0] = str(ROOT / "examples" / "train_nanogpt_schedule.py")
    train.main()


if __name__ == "__main__":
    main()
