"""A batch on the wire between a remote worker and the trainer: tensors as numpy byte arrays.

Why not the tensors themselves: Ray's serialiser writes numpy arrays out of band, straight into
the task's reply or the object store (and ``ray.get`` hands them back without a copy), while a
torch tensor goes through torch's own pickle reduction, a copy into the pickle stream. So the
worker sends each tensor as a flat ``uint8`` view of its bytes plus its dtype and shape
(``WireTensor``: a view, no copy on the worker), and the trainer rebuilds it with one copy out of
Ray's memory (the reply, ``RayWorkers(inline_bytes=)``, or the object store) into memory of its
own (pinned when the loader pins): the object is then freed at once, so Ray holds no more than
the batches in flight, and the consumer gets ordinary writable tensors (Ray's buffers are
read-only). Nothing here unpickles data: the arrays are raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stallfree.loader.shm.storage import map_leaves


@dataclass(frozen=True)
class WireTensor:
    """One tensor of a batch: its bytes (a flat uint8 array), dtype and shape."""

    data: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]


def to_wire(batch: Any) -> tuple[Any, int]:
    """``batch`` with every CPU tensor as a :class:`WireTensor` (views, no copies), and the bytes
    of tensor data it carries."""
    sent = [0]

    def leaf(t: torch.Tensor) -> WireTensor:
        t = t.detach().cpu().contiguous()
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        sent[0] += flat.numel()
        return WireTensor(flat.numpy(), t.dtype, tuple(t.shape))

    return map_leaves(batch, torch.Tensor, leaf), sent[0]


def from_wire(batch: Any, pin: bool = False) -> Any:
    """``batch`` with every :class:`WireTensor` a tensor of its own (one copy out of the object
    store; pinned with ``pin``)."""

    def leaf(w: WireTensor) -> torch.Tensor:
        out = torch.empty(w.shape, dtype=w.dtype, pin_memory=pin)
        if w.data.size:
            np.copyto(out.reshape(-1).view(torch.uint8).numpy(), w.data)
        return out

    return map_leaves(batch, WireTensor, leaf)
