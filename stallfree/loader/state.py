"""Resume state: a tiny JSON-serialisable dict of what the consumer has received.

Only (seed, epoch, global position) are needed because the order is a pure function of them,
given the order's layout, which the state names (``order``: see ``order.order_identity``) so a
state is never continued on another one; the world size and worker count at save time are kept
for information and never required to match.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FORMAT = "stallfree.loader.state"
VERSION = 1


@dataclass(frozen=True)
class LoaderState:
    seed: int
    epoch: int
    consumed: int  # global positions of the epoch's order consumed (all ranks together)
    dataset_len: int
    mode: str = "fast"  # "fast": our order; "sampler" / "iterable": resumed by skipping batches
    batches: int = 0  # batches this rank received in the epoch (used by the sampler and iterable modes)
    world_size: int = 1
    dataset: dict[str, Any] | None = None  # what the dataset needs to check a resume (a mixture's state)
    order: str | None = None  # the order's layout (order.order_identity); None: torch's sampler, a stream

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "mode": self.mode,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dataset_len": self.dataset_len,
            "batches": self.batches,
            "world_size": self.world_size,
            **({"dataset": dict(self.dataset)} if self.dataset is not None else {}),
            **({"order": self.order} if self.order is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoaderState:
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise ValueError(
                f"not a stallfree loader state (format {d.get('format') if isinstance(d, Mapping) else d!r})"
            )
        if d.get("version") != VERSION:
            raise ValueError(
                f"unsupported loader state version {d.get('version')!r} (this build reads {VERSION})"
            )
        try:
            return cls(
                seed=int(d["seed"]),
                epoch=int(d["epoch"]),
                consumed=int(d["consumed"]),
                dataset_len=int(d["dataset_len"]),
                mode=str(d.get("mode", "fast")),
                batches=int(d.get("batches", 0)),
                world_size=int(d.get("world_size", 1)),
                dataset=dict(d["dataset"]) if isinstance(d.get("dataset"), Mapping) else None,
                order=str(d["order"]) if d.get("order") is not None else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed loader state: {exc}") from exc
