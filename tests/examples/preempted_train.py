"""examples/train_images.py, preempted: once rank 0 has written the checkpoint of step
``STALLFREE_TEST_KILL_AT``, it SIGKILLs itself, as a lost node would; torchrun then stops the
other rank. The test knows exactly which step the checkpoint covers, however fast steps run."""

import importlib.util
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    kill_at = int(os.environ["STALLFREE_TEST_KILL_AT"])
    spec = importlib.util.spec_from_file_location("train_images", ROOT / "examples" / "train_images.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    save = train.save

    def save_then_preempt(path, model, optim, loader, step, rank, distributed):
        save(path, model, optim, loader, step, rank, distributed)
        if rank == 0 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    train.save = save_then_preempt
    sys.argv[0] = str(ROOT / "examples" / "train_images.py")
    train.main()


if __name__ == "__main__":
    main()
