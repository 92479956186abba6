"""Small datasets and collates for the trace tests (module level: workers unpickle them)."""

from __future__ import annotations

import torch

import stallfree
from stallfree.shards.writer import ShardWriter


class Items(torch.utils.data.Dataset):
    """Dict samples naming themselves."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"name": self.name, "i": i}


def keys_of(batch: list[dict]) -> list[str]:
    """Collate to the samples' keys: what the batch held, nothing else."""
    return [s["__key__"] for s in batch]


def mixture_keys(batch: dict) -> list[tuple[str, int]]:
    return list(zip(batch["__source__"], batch["i"].tolist(), strict=True))


def write_images(root, n: int = 37, per_shard: int = 6) -> str:
    """A tar dataset of ``n`` samples (payload bytes stand in for images), ``per_shard`` a shard."""
    with ShardWriter(str(root), format="tar", max_samples=per_shard) as w:
        for i in range(n):
            w.write({"__key__": f"img{i:04d}", "jpg": bytes([i % 251]) * (100 + i), "cls": i % 3})
    return str(root)


def three_stage_mixture(seed: int = 5) -> stallfree.mix.Mixture:
    """Three sources over a three-stage schedule whose boundaries fall mid-epoch and mid-batch."""
    schedule = stallfree.mix.stages(
        [
            (0, {"web": 0.7, "code": 0.3, "math": 0.0}),
            (53, {"web": 0.4, "code": 0.4, "math": 0.2}),
            (171, {"web": 0.1, "code": 0.2, "math": 0.7}),
        ]
    )
    sources = {"web": Items("web", 40), "code": Items("code", 17), "math": Items("math", 9)}
    return stallfree.mix(sources, schedule, samples_per_epoch=97, seed=seed)
