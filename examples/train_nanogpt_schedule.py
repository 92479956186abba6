"""nanoGPT-style pre-training on a three-stage data mixture, with stallfree.DataLoader: weights
that change with progress, resume on any number of processes, and the samples of any step.

    python examples/train_nanogpt_schedule.py --make-data ./lm-data          # once: 3 token corpora
    torchrun --nproc-per-node 2 examples/train_nanogpt_schedule.py --data ./lm-data --out ./run

The mixture reads web text, then more code, then mostly math (``stallfree.mix.stages``, keyed on
the global sample position: the same schedule on any world size). Kill it at any time and run
the same command again with any number of processes: it goes on from ``./run/ckpt`` (the
model, the optimiser and the loader's state, a few hundred bytes of JSON) with nothing lost or
repeated, across stage boundaries too.

A loss spike? Every step's loss is in ``./run/loss.jsonl``. List what a step trained on, from the
checkpoint alone (no sample ids were logged during training):

    stallfree trace ./run/ckpt/loader.json --step 41 --rank 1 \\
        --dataset examples.train_nanogpt_schedule:mixture --dataset-arg ./lm-data

and resume from a checkpoint before it, leaving those batches out on every rank:

    torchrun --nproc-per-node 2 examples/train_nanogpt_schedule.py --data ./lm-data --out ./run \\
        --skip-steps 40:43

``--record-keys DIR`` keeps a compact per-rank record of every batch delivered;
``stallfree audit DIR`` then checks that each sample of each epoch was delivered exactly once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import stallfree

SOURCES = ("web", "code", "math")
VOCAB = 256
SEQ_LEN = 32


def mixture(data: str, samples_per_epoch: int = 960) -> stallfree.mix.Mixture:
    """The training mixture: three packed token corpora under a three-stage schedule (positions
    are global sample positions: epoch * samples_per_epoch + position)."""
    schedule = stallfree.mix.stages(
        [
            (0, {"web": 0.8, "code": 0.2, "math": 0.0}),  # warm-up on web text
            (samples_per_epoch // 2, {"web": 0.5, "code": 0.3, "math": 0.2}),
            (samples_per_epoch, {"web": 0.2, "code": 0.2, "math": 0.6}),  # anneal on math
        ]
    )
    corpora = {name: stallfree.TokenDataset(os.path.join(data, name), SEQ_LEN) for name in SOURCES}
    return stallfree.mix(corpora, schedule, samples_per_epoch=samples_per_epoch, seed=1234)


def make_data(root: str, documents: int = 400) -> None:
    """Three small corpora of random documents, each with its own token range."""
    from stallfree.tokens.megatron import MegatronWriter

    rng = np.random.default_rng(0)
    os.makedirs(root, exist_ok=True)
    for k, name in enumerate(SOURCES):
        with MegatronWriter(os.path.join(root, name), dtype="uint16") as w:
            for _ in range(documents):
                w.write(rng.integers(k * 80, k * 80 + 80, size=int(rng.integers(5, 60))))


class TinyGPT(nn.Module):
    """Token and position embeddings, causal self-attention blocks, a tied head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(SEQ_LEN, dim)
        block = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.norm(x) @ self.tok.weight.T


def save(out: Path, model: nn.Module, optim: torch.optim.Optimizer, loader: Any, step: int) -> None:
    """Rank 0 writes the checkpoint; each file goes in whole or not at all (temp + rename). The
    loader's state is the same on every rank (a global position), so one copy serves all."""
    state = loader.state_dict()  # every rank: it also flushes that rank's --record-keys file
    if dist.get_rank() != 0:
        return
    ckpt = out / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / "model.pt.tmp"
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, tmp)
    os.replace(tmp, ckpt / "model.pt")
    (ckpt / "loader.json.tmp").write_text(json.dumps(state))
    os.replace(ckpt / "loader.json.tmp", ckpt / "loader.json")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-data", metavar="DIR", help="write three small token corpora to DIR and exit")
    p.add_argument("--data", help="the directory --make-data wrote")
    p.add_argument("--out", default="./run", help="checkpoints, loss.jsonl")
    p.add_argument("--steps", type=int, default=80, help="train until this step")
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=1, help="loader worker processes per rank")
    p.add_argument("--skip-steps", action="append", default=[], metavar="A:B", help="leave out steps A..B-1")
    p.add_argument("--record-keys", default=None, metavar="DIR", help="the loader's delivery record")
    p.add_argument("--log-batches", default=None, help="append each step's samples (source, documents) here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.make_data:
        make_data(args.make_data)
        return
    if not args.data:
        raise SystemExit("--data is required (write one with --make-data DIR)")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    )
    torch.manual_seed(0)
    out = Path(args.out)
    model = nn.parallel.DistributedDataParallel(TinyGPT().to(device))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = stallfree.DataLoader(
        mixture(args.data), batch_size=args.batch_size, num_workers=args.workers, record_keys=args.record_keys
    )  # the world comes from torch.distributed; the mixture sets the order
    step = 0
    if (out / "ckpt" / "model.pt").exists():
        saved = torch.load(out / "ckpt" / "model.pt", map_location=device)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        skips = [tuple(int(x) for x in s.split(":")) for s in args.skip_steps]
        loader.load_state_dict(json.loads((out / "ckpt" / "loader.json").read_text()), skip_steps=skips)
        step = saved["step"]
        if rank == 0:
            print(
                f"resumed at step {step} on {world} process(es); loader state {loader.state_dict()['step']}"
            )
    out.mkdir(parents=True, exist_ok=True)
    losses = open(out / "loss.jsonl", "a") if rank == 0 else None  # noqa: SIM115
    log = open(f"{args.log_batches}.{rank}", "a") if args.log_batches else None  # noqa: SIM115
    while step < args.steps:
        for batch in loader:
            ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            if log is not None:
                docs = [sorted(set(d.tolist())) for d in batch["doc_ids"]]
                log.write(
                    json.dumps({"step": step, "samples": list(zip(batch["__source__"], docs, strict=True))})
                    + "\n"
                )
                log.flush()
            if losses is not None:
                shares = loader.stats()["mix"]["fractions"]["target"]
                row = {"step": step, "loss": round(loss.item(), 4), "target": shares}
                losses.write(json.dumps(row) + "\n")
                losses.flush()
            step += 1
            if step % args.ckpt_every == 0:
                save(out, model, optim, loader, step)
            if step >= args.steps:
                break
    if losses is not None:
        rows = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
        worst = max(rows[len(rows) // 4 :], key=lambda r: r["loss"] if math.isfinite(r["loss"]) else 1e9)
        print(
            f"trained to step {step}; highest loss after warm-up at step {worst['step']}: see what it read with"
        )
        print(
            f"  stallfree trace {out}/ckpt/loader.json --step {worst['step']} --dataset examples.train_nanogpt_schedule:mixture --dataset-arg {args.data}"
        )
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
