"""Image classification with accelerate and stallfree.DataLoader + ImageDecode; checkpoints and resumes.

Run (one node, N processes; CPU works, GPUs too):

    stallfree shard ./imagenet/train ./in1k --max-bytes 256MB       # once: ImageFolder -> shards
    accelerate launch --num-processes 8 examples/train_accelerate.py --data ./in1k --ckpt-dir ./ckpt
    # or: torchrun --nproc-per-node 8 examples/train_accelerate.py --data ./in1k --ckpt-dir ./ckpt

The one change from a stock accelerate script is the import of ``Accelerator`` from
``stallfree.integrations.accelerate``: ``accelerator.prepare`` then hands the stallfree loader
back as it is (its ``decode=``, rank split, ``stats()`` intact; stock accelerate would rebuild
it as a plain torch loader), and ``save_state`` / ``load_state`` carry its position (JSON) with
no extra call. Kill it at any time and run the same command again, with any number of
processes: it goes on from the newest checkpoint in ``--ckpt-dir`` with no sample lost or
repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import torch
import torch.nn as nn

import stallfree
from stallfree.integrations.accelerate import Accelerator


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset URL: a shard directory, s3://..., ...")
    p.add_argument("--ckpt-dir", required=True, help="checkpoints go to DIR/step_N (newest resumed on start)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--size", type=int, default=224, help="crop size")
    p.add_argument("--workers", type=int, default=4, help="loader worker processes per rank")
    p.add_argument("--ckpt-every", type=int, default=500, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, help="append each batch's sample keys here (JSON lines)")
    return p.parse_args()


def small_net(classes: int) -> nn.Module:
    """A stand-in model; use torchvision's resnet50 (or yours) in a real run."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def newest_checkpoint(root: Path) -> tuple[Path, int] | None:
    """The complete checkpoint with the highest step (``step_N``; a ``.partial`` one never counts)."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name))]
    if not found:
        return None
    step, path = max(found)
    return path, step


def save(accelerator: Accelerator, root: Path, step: int) -> None:
    """Every process writes its part into ``step_N.partial``; once all have, the main process
    renames it ``step_N``, so a checkpoint found on start is whole."""
    partial = root / f"step_{step}.partial"
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.replace(partial, root / f"step_{step}")
        print(f"checkpoint: step {step}", flush=True)
    accelerator.wait_for_everyone()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)  # the same initial weights on every process
    # starts torch.distributed (build the loader after it); on CPU-only machines accelerate needs
    # cpu=True to run one process per torchrun rank, otherwise every process believes it is alone
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    device = accelerator.device
    dataset = stallfree.open_dataset(args.data)
    classes = len(dataset.manifest.classes or []) or 1000
    loader = stallfree.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        seed=args.seed,
        num_workers=args.workers,
        decode=stallfree.ImageDecode(
            train=True, size=args.size, device=device if device.type == "cuda" else "cpu"
        ),
        device=device if device.type == "cuda" else None,  # accelerate does not move our batches
        drop_last=True,
    )
    model = small_net(classes)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optim, loader = accelerator.prepare(model, optim, loader)  # the loader comes back as it is

    root = Path(args.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    step, start_epoch = 0, 0
    newest = newest_checkpoint(root)
    if newest is not None:  # model, optimiser, RNGs and the loader's position
        accelerator.load_state(str(newest[0]))
        step, start_epoch = newest[1], loader.state_dict()["epoch"]
    log = open(f"{args.log_keys}.{accelerator.process_index}", "a") if args.log_keys else None  # noqa: SIM115

    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)  # the resumed epoch keeps the position load_state restored
        for batch in loader:
            if log is not None:  # before the step: a checkpoint never covers a batch not logged
                log.write(json.dumps({"step": step + 1, "keys": list(batch["__key__"])}) + "\n")
                log.flush()
            loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            optim.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optim.step()
            step += 1
            if step % args.ckpt_every == 0:
                save(accelerator, root, step)
    stats = loader.stats()
    print(
        f"rank {accelerator.process_index}: {stats['batches']} batches, "
        f"decode in {stats.get('decode', {}).get('where', '-')}, "
        f"waited for data {100 * stats['wait_fraction']:.1f}% of the time",
        flush=True,
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
