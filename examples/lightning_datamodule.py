"""PyTorch Lightning with stallfree: a LightningDataModule whose loaders are stallfree.DataLoaders,
with exact mid-epoch resume through Lightning's own checkpoint.

Run (needs `pip install -r examples/requirements.txt`):

    python examples/lightning_datamodule.py --ckpt-dir ./ckpts                 # tiny made-up data
    python examples/lightning_datamodule.py --train ./in1k --val ./in1k-val --ckpt-dir ./ckpts

Lightning picks the devices (every GPU of the machine, one DDP process each; the CPU without).
Stop it at any time and run the same command again: it resumes from ckpt-dir/last.ckpt with no
training sample lost or repeated. The DataModule puts the loader's `state_dict()` (a small JSON
dict: seed, epoch, global position) into the checkpoint, and loads it into the new loader.

Three things to know when you bring your own module:
- `use_distributed_sampler=False`: stallfree splits its seeded order across ranks itself; Lightning
  must not swap in a DistributedSampler (that would turn the fast path off).
- `set_epoch` is not needed: every `iter()` of the loader starts the next epoch by itself, and
  Lightning calls `iter()` once per epoch. Calling `set_epoch(epoch)` each epoch (in a hook) is
  fine, also for the resumed one: it goes on from its saved position.
- The loader has a length, so Lightning does not fetch a batch ahead: the state saved with a
  checkpoint covers exactly the batches trained on so far.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image

import stallfree

CLASSES = ["red", "green", "blue"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", default=None, help="training shards (any URL); default: make tiny data")
    p.add_argument("--val", default=None, help="validation shards; default: the tiny data's val split")
    p.add_argument("--ckpt-dir", required=True, help="checkpoints; resumes from last.ckpt there")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: no limit)")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--size", type=int, default=224, help="crop size")
    p.add_argument("--workers", type=int, default=4, help="loader worker processes per rank")
    p.add_argument("--ckpt-every", type=int, default=500, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-keys", default=None, help="append each step's sample keys here (JSON lines)")
    return p.parse_args()


def make_tiny_data(dst: Path, n: int, seed: int) -> str:
    """`n` small JPEGs in 3 classes (the dominant colour) as tar shards; kept if already there."""
    if not (dst / "manifest.json").exists():
        rng = np.random.default_rng(seed)
        with stallfree.ShardWriter(str(dst), format="tar", max_samples=16, classes=CLASSES) as w:
            for i in range(n):
                cls = i % len(CLASSES)
                pixels = rng.integers(0, 96, (40, 48, 3), dtype=np.uint8)
                pixels[..., cls] += 128
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
                w.write({"__key__": f"img{i:04d}", "jpg": buf.getvalue(), "cls": cls})
    return str(dst)


class StallfreeDataModule(L.LightningDataModule):
    """stallfree.DataLoaders for train and val; the train loader's position rides in the checkpoint."""

    def __init__(self, train: str, val: str | None, batch_size: int, size: int, workers: int, seed: int):
        super().__init__()
        self.train_url, self.val_url = train, val
        self.batch_size, self.size, self.workers, self.seed = batch_size, size, workers, seed
        self._train_loader: stallfree.DataLoader | None = None
        self._resume: dict[str, Any] | None = None

    def _device(self) -> str:
        # Decode straight onto this rank's device (DALI on a GPU); Lightning's own copy is then a no-op.
        return str(self.trainer.strategy.root_device) if self.trainer is not None else "cpu"

    def train_dataloader(self) -> stallfree.DataLoader:
        loader = stallfree.DataLoader(
            stallfree.open_dataset(self.train_url),
            batch_size=self.batch_size,
            shuffle=True,
            seed=self.seed,
            num_workers=self.workers,
            decode=stallfree.ImageDecode(train=True, size=self.size, device=self._device()),
            drop_last=True,
        )
        if self._resume is not None:  # restored by load_state_dict before Lightning asks for loaders
            loader.load_state_dict(self._resume)
            self._resume = None
        self._train_loader = loader
        return loader

    def val_dataloader(self) -> stallfree.DataLoader | list:
        if self.val_url is None:
            return []
        return stallfree.DataLoader(
            stallfree.open_dataset(self.val_url),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.workers,
            decode=stallfree.ImageDecode(train=False, size=self.size, device=self._device()),
        )

    # Lightning calls these when it writes / reads a checkpoint (checkpoint["StallfreeDataModule"]).
    def state_dict(self) -> dict[str, Any]:
        if self._train_loader is None:
            return {}
        return {"train_loader": self._train_loader.state_dict()}  # JSON-safe; any world size resumes it

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = state.get("train_loader")
        if self._train_loader is not None and self._resume is not None:
            self._train_loader.load_state_dict(self._resume)  # takes effect at its next iter()


class SmallClassifier(L.LightningModule):
    """A stand-in model; put torchvision's resnet50 (or yours) here in a real run."""

    def __init__(self, classes: int, log_keys: str | None = None):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, classes),
        )
        self.log_keys = log_keys

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.log_keys is not None:  # before the step: a checkpoint never covers a batch not logged
            with open(f"{self.log_keys}.{self.global_rank}", "a") as f:
                step = {
                    "step": self.global_step + 1,
                    "epoch": self.current_epoch,
                    "keys": list(batch["__key__"]),
                }
                f.write(json.dumps(step) + "\n")
        loss = nn.functional.cross_entropy(self.net(batch["image"]), batch["label"])
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["label"]))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        acc = (self.net(batch["image"]).argmax(1) == batch["label"]).float().mean()
        self.log("val_acc", acc, prog_bar=True, batch_size=len(batch["label"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    args = parse_args()
    ckpt_dir = Path(args.ckpt_dir)
    train, val = args.train, args.val
    if train is None:  # tiny made-up data beside the checkpoint folder, so the example runs anywhere
        tiny = ckpt_dir.parent / f"{ckpt_dir.name}-tinydata"
        train = make_tiny_data(tiny / "train", 96, seed=0)
        val = val or make_tiny_data(tiny / "val", 24, seed=1)
    classes = len(stallfree.open_dataset(train).manifest.classes or []) or 1000
    data = StallfreeDataModule(train, val, args.batch_size, args.size, args.workers, args.seed)
    model = SmallClassifier(classes, log_keys=args.log_keys)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # the loader shards its seeded order across ranks itself
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    last = ckpt_dir / "last.ckpt"
    trainer.fit(model, datamodule=data, ckpt_path=str(last) if last.exists() else None)
    if trainer.is_global_zero:
        print(f"done: step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
