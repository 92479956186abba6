"""A worker's shared-memory slots: reused batch buffers leased to the main process.

A slot comes back once the consumer has dropped every tensor of its batch; the worker writes the
next batch into it through its shm file where it can (shm.SlotFile), so it never maps the pages.
"""

from __future__ import annotations

import numpy as np
import torch

from stallfree.loader import _torch_compat as compat
from stallfree.loader import fdlimit
from stallfree.loader.shm import heap
from stallfree.loader.shm import storage as shm
from stallfree.loader.shm.returns import SlotReturns


class Slots:
    """The worker's shared slots. A slot is leased to the main process with a batch and comes
    back (through ``returns``) once the consumer has dropped every tensor of that batch. In-flight
    batches are bounded by the main process's dispatching, so a missing free slot means the
    consumer is keeping batches: then a new slot is made rather than waiting (no deadlock), and
    slots beyond ``max_slots`` are given up again once they come back.

    A batch the user keeps is theirs (``list(loader)`` keeps them all, as with torch). Once the
    pool holds ``HARD_CAP`` slots and every one is held, the next batch goes out in a *handover*
    slot: a fresh segment the consumer owns outright, never returned and never reused, freed when
    the consumer drops the batch (torch's way for every batch). Before, the worker waited here for
    a slot the consumer would never give back: the epoch hung and ended in a WorkerHungError.
    Memory stays bounded by what the consumer keeps; the pool itself never exceeds ``HARD_CAP``.
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
        self.pooled = 0  # slots of the reusable pool (storages also holds handover slots)
        self.handover: set[int] = set()  # slots whose storage goes to the consumer for good

    def _drain(self) -> None:
        self.free.extend(self.returns.take_ready())

    def acquire(self) -> int:
        """A slot for the next batch; never waits (a handover slot once the pool is all held)."""
        self._drain()
        if len(self.free) > self.max_slots:  # a burst of kept batches is over: shrink back
            while len(self.free) > self.max_slots:
                k = self.free.pop()
                self._vacate(k)
                self.pooled -= 1
                self.dropped.append(k)
            heap.trim_heap()
        if self.free:
            return self.free.pop()
        if self.vacant:
            k = self.vacant.pop()
        else:
            self.storages.append(None)
            k = len(self.storages) - 1
        if self.pooled < self.HARD_CAP:
            self.pooled += 1
        else:
            self.handover.add(k)
        if self.last_size:  # size a new slot like the last batch: collate goes straight in
            self.grow(k, self.last_size)
            self.fresh.append(k)
        return k

    def _vacate(self, slot: int) -> None:
        self.storages[slot] = None
        self.files.pop(slot, None)
        if slot in self.fresh:
            self.fresh.remove(slot)
        self.vacant.append(slot)

    def is_handover(self, slot: int) -> bool:
        return slot in self.handover

    def handed_over(self, slot: int) -> None:
        """The batch in handover ``slot`` is sent: drop this worker's reference to its storage
        (the message holds it until it is pickled; then the consumer's copy is the only one)."""
        if slot in self.handover:
            self.handover.discard(slot)
            self._vacate(slot)

    def unused(self, slot: int) -> None:
        """A slot acquired for a batch that will not be sent in it (failed, or nothing to share)."""
        if slot in self.handover:
            self.handed_over(slot)
        else:
            self.free.append(slot)

    def take_dropped(self) -> list[int]:
        out, self.dropped = self.dropped, []
        return out

    def grow(self, slot: int, nbytes: int) -> torch.UntypedStorage:
        try:
            storage = compat.new_shared_storage(max(nbytes, 1 << 16))
        except RuntimeError as exc:  # torch's "unable to open shared memory object": say why, if that is why
            if fdlimit.out_of_descriptors():
                raise fdlimit.too_many_open_files("a worker made a shared-memory slot") from exc
            raise
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
        if slot in self.handover:
            self.handed_over(slot)
            return
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
