"""Image training whose decode runs on a Ray cluster's CPU nodes as well as on the GPU node's own
cores: ``stallfree.DataLoader(..., remote=stallfree.RayWorkers(...))``.

On each CPU node (once; the resource name is yours, it keeps the remote workers off the GPU nodes):

    ray start --address HEAD_IP:6379 --num-cpus 32 --resources '{"cpu_node": 32}'

(the head: ``ray start --head --port 6379 --num-cpus 0 --resources '{}'`` on any machine). On the
GPU node(s), as usual:

    torchrun --nproc-per-node 8 examples/train_ray_remote.py --data ./in1k \
        --ray-address HEAD_IP:6379 --remote-workers 4 --ckpt ./ckpt.pt

Every rank keeps its own ``--workers`` loader processes and adds ``--remote-workers`` Ray actors of
``--remote-cpus`` CPUs each: the local workers are used first, the remote ones take what they
cannot. Each remote worker decodes (JPEG + RandomResizedCrop + flip, uint8) from the loader's own
plan, so batches, order and ``state_dict()`` are exactly what the local loader would give:
kill it and run it again with any number of ranks and any ``--remote-workers`` (0 included) and it
goes on from the checkpoint with no sample lost or repeated. ``loader.stats()["remote"]`` says
where batches were made and what they cost; rank 0 prints it at the end.

The dataset's URL must be readable from the CPU nodes too (an object store, a shared file system;
a path on the GPU node's local disk only works where it is the same on every node).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import stallfree


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset URL readable from every node")
    p.add_argument("--ray-address", required=True, help="the Ray cluster, HOST:PORT (or auto)")
    p.add_argument("--remote-workers", type=int, default=2, help="Ray actors per rank (0: none)")
    p.add_argument("--remote-cpus", type=float, default=1, help="CPUs each remote worker reserves")
    p.add_argument("--resource", default="cpu_node", help="the custom resource the CPU nodes carry")
    p.add_argument("--ckpt", required=True, help="checkpoint file (written atomically, read on start)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--size", type=int, default=224, help="crop size")
    p.add_argument("--workers", type=int, default=4, help="local loader worker processes per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, help="append each batch's sample keys here (JSON lines)")
    return p.parse_args()


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

    dataset = stallfree.open_dataset(args.data)
    classes = len(dataset.manifest.classes or []) or 1000
    remote = None
    if args.remote_workers > 0:
        remote = stallfree.RayWorkers(
            args.remote_workers,
            cpus_per_worker=args.remote_cpus,
            resources={args.resource: args.remote_cpus},
            address=args.ray_address,
        )
    # The CPU decoder runs in every worker, local or remote; uint8 pixels travel (a quarter of
    # float32's bytes) and are normalised on the GPU after the copy.
    loader = stallfree.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        seed=args.seed,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        decode=stallfree.ImageDecode(
            train=True, size=args.size, backend="cpu", transfer="uint8" if cuda else None
        ),
        device=device if cuda else None,
        drop_last=True,
        remote=remote,
    )
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    ).to(device)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step, start_epoch = 0, 0
    if os.path.exists(args.ckpt):  # resume: model, optimiser and the loader's position
        ckpt = torch.load(args.ckpt, map_location=device, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        loader.load_state_dict(json.loads(ckpt["loader"]))  # any world size, any worker mix
        step, start_epoch = ckpt["step"], json.loads(ckpt["loader"])["epoch"]
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model
    log = open(f"{args.log_keys}.{rank}", "a") if args.log_keys else None  # noqa: SIM115

    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            if log is not None:
                log.write(json.dumps({"step": step + 1, "keys": list(batch["__key__"])}) + "\n")
                log.flush()
            loss = nn.functional.cross_entropy(ddp(batch["image"]), batch["label"])
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            step += 1
    if distributed:
        dist.barrier()
    if rank == 0:
        state = {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "loader": json.dumps(loader.state_dict()),
            "step": step,
        }
        torch.save(state, args.ckpt + ".tmp")
        os.replace(args.ckpt + ".tmp", args.ckpt)
    stats = loader.stats().get("remote")
    if stats is not None:
        summary = {k: v for k, v in stats.items() if k != "workers"}
        # one write for the whole line: torchrun's ranks share its stdout, and print() writes the
        # newline apart where output is unbuffered (PYTHONUNBUFFERED), so two ranks' lines ran together
        sys.stdout.write(f"rank {rank} remote: {json.dumps(summary)}\n")
        sys.stdout.flush()
    loader.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
