"""Image classification with DDP, stallfree.DataLoader and ImageDecode; checkpoints and resumes.

Run (one node, N processes; CPU works with gloo, GPUs with nccl):

    stallfree shard ./imagenet/train ./in1k --max-bytes 256MB       # once: ImageFolder -> shards
    torchrun --nproc-per-node 8 examples/train_images.py --data ./in1k --ckpt ./ckpt.pt

Data in an object store: pass its URL and fsspec storage options (or use the standard AWS_*
variables, which s3fs reads itself):

    torchrun --nproc-per-node 8 examples/train_images.py --data s3://bucket/in1k --ckpt ./ckpt.pt \
        -o endpoint_url=https://minio.example:9000 -o key=... -o secret=...

Kill it at any time and run the same command again (with any number of processes): it goes on
from the last checkpoint with no sample lost or repeated, because the loader's state is a global
position in a seeded epoch order, not a per-rank count. Calling `set_epoch(epoch)` each epoch is
fine, also for the resumed one.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import stallfree


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset URL: a shard directory, s3://..., ...")
    p.add_argument("--ckpt", required=True, help="checkpoint file (written atomically, read on start)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--size", type=int, default=224, help="crop size")
    p.add_argument("--workers", type=int, default=4, help="loader worker processes per rank")
    p.add_argument("--ckpt-every", type=int, default=500, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, help="append each batch's sample keys here (JSON lines)")
    p.add_argument(
        "-o",
        "--storage-option",
        action="append",
        default=[],
        type=storage_option,
        metavar="KEY=VALUE",
        help="fsspec storage option for --data, e.g. endpoint_url=... or anon=true (repeatable)",
    )
    return p.parse_args()


def storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``, the value read as JSON when it parses (numbers, true/false, dicts)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"storage option must be KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def small_net(classes: int) -> nn.Module:
    """A stand-in model; use torchvision's resnet50 (or yours) in a real run."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def main() -> None:
    args = parse_args()
    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    cuda = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)

    dataset = stallfree.open_dataset(args.data, **dict(args.storage_option))
    classes = len(dataset.manifest.classes or []) or 1000
    # The loader splits the seeded epoch order across ranks itself (no DistributedSampler), and
    # decodes whole batches: on the GPU with DALI when there is one, with the CPU backend otherwise.
    loader = stallfree.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        seed=args.seed,
        num_workers=args.workers,
        decode=stallfree.ImageDecode(train=True, size=args.size, device=device if cuda else "cpu"),
        drop_last=True,
    )
    model = small_net(classes).to(device)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step, start_epoch = 0, 0
    if os.path.exists(args.ckpt):  # resume: model, optimiser and the loader's position
        ckpt = torch.load(args.ckpt, map_location=device, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        loader.load_state_dict(json.loads(ckpt["loader"]))  # any world size may resume it
        step, start_epoch = ckpt["step"], json.loads(ckpt["loader"])["epoch"]
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model
    log = open(f"{args.log_keys}.{rank}", "a") if args.log_keys else None  # noqa: SIM115

    for epoch in range(start_epoch, args.epochs):
        # fine for the resumed epoch too: there set_epoch keeps the position load_state_dict restored
        loader.set_epoch(epoch)
        for batch in loader:
            if log is not None:  # before the step: a checkpoint never covers a batch not logged
                log.write(json.dumps({"step": step + 1, "keys": list(batch["__key__"])}) + "\n")
                log.flush()
            loss = nn.functional.cross_entropy(ddp(batch["image"]), batch["label"])
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            step += 1
            if step % args.ckpt_every == 0:
                save(args.ckpt, model, optim, loader, step, rank, distributed)
    save(args.ckpt, model, optim, loader, step, rank, distributed)
    if distributed:
        dist.destroy_process_group()


def save(path, model, optim, loader, step, rank, distributed) -> None:
    """Rank 0 writes the checkpoint atomically once every rank is past this step."""
    if distributed:
        dist.barrier()
    if rank == 0:
        state = {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "loader": json.dumps(loader.state_dict()),  # JSON: global position, seed, epoch
            "step": step,
        }
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"checkpoint: step {step}", flush=True)


if __name__ == "__main__":
    main()
