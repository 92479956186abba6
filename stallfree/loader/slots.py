"""A worker's shared-memory slots: reused batch buffers leased to the main process.

A slot comes back once the consumer has dropped every tensor of its batch; the worker writes the
next batch into it through its shm file where it can (shm.SlotFile), so it never maps the pages.
"""

from __future__ import annotations

import numpy as np
import torch

from stallfree.loader import _torch_compat as compat
from stallfree.loader import shm
from stallfree.loader.returns import SlotReturns


class Slots:
    """The worker's shared slots. A slot is leased to the main process with a batch and comes
    back (through ``returns``) once the consumer has dropped every tensor of that batch. In-flight
    batches are bounded by the main process's dispatching, so a missing free slot means the
    consumer is keeping batches: then a new slot is made rather than waiting (no deadlock), and
    slots beyond ``max_slots`` are given up again once they come back.
    """

    HARD_CAP = 256

    def __init__(self, max_slots: int, returns: SlotReturns) -> None:
        self.storages: list[torch.UntypedStorage | None] = []
        self.free: list[int] = []
        self.vacant: list[int] = []
        self.dropped: list[int] = []
        self.max_slots = max_slots
        self.returns = returns
        self.last_size = 0
        self.fresh: list[int] = []  # slots made ahead whose storage the main process has not seen
        self.files: dict[int, shm.SlotFile | None] = {}

    def _drain(self) -> None:
        self.free.extend(self.returns.take_ready())

    def acquire(self) -> int:
        self._drain()
        while len(self.free) > self.max_slots:  # a burst of kept batches is over: shrink back
            k = self.free.pop()
            self.storages[k] = None
            self.files.pop(k, None)
            self.vacant.append(k)
            self.dropped.append(k)
        if self.free:
            return self.free.pop()
        if self.vacant:
            k = self.vacant.pop()
        elif len(self.storages) < self.HARD_CAP:
            self.storages.append(None)
            k = len(self.storages) - 1
        else:
            slot = self.returns.wait()
            if slot is None:
                raise RuntimeError("the loader's main process is gone: no slot will come back")
            return slot
        if self.last_size:  # size a new slot like the last batch: collate goes straight in
            self.grow(k, self.last_size)
            self.fresh.append(k)
        return k

    def take_dropped(self) -> list[int]:
        out, self.dropped = self.dropped, []
        return out

    def grow(self, slot: int, nbytes: int) -> torch.UntypedStorage:
        storage = compat.new_shared_storage(max(nbytes, 1 << 16))
        self.storages[slot] = storage
        self.files.pop(slot, None)
        self.last_size = max(self.last_size, nbytes)
        return storage

    def reserve(self, slot: int, nbytes: int) -> torch.UntypedStorage:
        """The slot's storage, grown first if it holds fewer than ``nbytes`` (nothing in it yet)."""
        storage = self.storages[slot]
        if storage is None or storage.nbytes() < nbytes:
            storage = self.grow(slot, nbytes)
            if slot not in self.fresh:
                self.fresh.append(slot)
        return storage

    def file(self, slot: int) -> shm.SlotFile | None:
        """The slot's file for writes that need no mapping (None: write through the mapping)."""
        if slot not in self.files:
            storage = self.storages[slot]
            self.files[slot] = shm.SlotFile.of(storage) if storage is not None else None
        return self.files[slot]

    def give_back(self, slot: int, announced: torch.UntypedStorage | None) -> None:
        """Return an unused slot; one whose storage was about to be announced stays unannounced."""
        self.free.append(slot)
        if announced is not None:
            self.fresh.append(slot)

    def announce(self, slot: int) -> torch.UntypedStorage | None:
        """The slot's storage if the main process has not been sent it yet."""
        if slot in self.fresh:
            self.fresh.remove(slot)
            return self.storages[slot]
        return None


class SlotAlloc:
    """Handed to a worker-run batch decoder as ``alloc``: its output tensor is made in the slot."""

    def __init__(self, slots: Slots, slot: int) -> None:
        self.slots, self.slot = slots, slot
        self.arena: shm.Arena | None = None
        self.file: shm.SlotFile | None = None

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        self.arena = shm.Arena(self.slots.reserve(self.slot, nbytes + (64 << 10)))  # + labels
        self.file = self.slots.file(self.slot)
        return self.arena.alloc(shape, dtype)

    def put_row(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Write one finished image into its row without mapping the slot (see rows.py)."""
        shm.write_row(dst, src, self.file)
