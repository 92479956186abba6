"""examples/train_hf_trainer.py with the test's instruments: every training step appends the
window ids it trains on to ``--log-windows PREFIX.RANK`` (JSON lines; a window's id is its first
token // seq_len, since the test's corpus is ``arange``), and once rank 0 has written the
checkpoint of step ``--kill-at`` it SIGKILLs itself, as a lost node would (torchrun then stops
the other rank). ``--plain`` runs transformers' own Trainer with our loader instead (what users
did before the integration), to show what it loses and repeats."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parents[2]


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "train_hf_trainer", ROOT / "examples" / "train_hf_trainer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    argv = sys.argv[1:]
    own = {"--log-windows": None, "--kill-at": None}
    plain = "--plain" in argv
    argv = [a for a in argv if a != "--plain"]
    for flag in own:
        if flag in argv:
            i = argv.index(flag)
            own[flag] = argv[i + 1]
            del argv[i : i + 2]
    example = _load_example()
    args = example.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    prefix, kill_at = own["--log-windows"], own["--kill-at"]

    class Instrumented(transformers.TrainerCallback):
        def on_save(self, targs, state, control, **kwargs):
            if kill_at is not None and rank == 0 and state.global_step == int(kill_at):
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = example.build_trainer(args)
    if plain:  # transformers' own Trainer, handed our loader the way users did it
        ours = trainer.get_train_dataloader()
        trainer.__class__ = type(
            "Plain", (transformers.Trainer,), {"get_train_dataloader": lambda self: ours}
        )
    step_of = trainer.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        windows = (inputs["input_ids"][:, 0] // args.seq_len).tolist()
        with open(f"{prefix}.{rank}", "a") as f:
            f.write(json.dumps({"step": trainer.state.global_step + 1, "windows": windows}) + "\n")
        return step_of(model, inputs, num_items_in_batch)

    trainer.training_step = training_step
    trainer.add_callback(Instrumented())
    sys.argv[0] = str(ROOT / "examples" / "train_hf_trainer.py")
    resume = transformers.trainer_utils.get_last_checkpoint(args.out) if Path(args.out).is_dir() else None
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()
