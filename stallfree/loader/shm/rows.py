"""Collate while decoding: each sample's tensors go into their row of the batch as soon as the
sample is ready, and the sample's own copy is freed at once.

torch's worker keeps every decoded sample of a batch alive until ``default_collate`` stacks them
(batch bytes twice), then copies the stack into shared memory (three times). Writing rows straight
into the worker's shared slot keeps one batch plus one sample: less resident memory, and each row is
copied while the sample is still in cache, through the slot's file (``shm.SlotFile``: no page
faults, nothing mapped) or, where that is unavailable, through the mapping with each written row
let go of at once. The result is what ``default_collate`` would return:
only exact ``torch.Tensor`` leaves of one shape and dtype per position are streamed; anything else
(other leaves, a sample whose structure or shapes differ) is left to ``default_collate``'s own rules
and errors, with the rows written so far handed back as tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from stallfree.loader import contracts
from stallfree.loader.shm import storage as shm

Path = tuple[Any, ...]

# Below this many tensor bytes per sample, streaming costs more than it saves: each row would be a
# syscall plus ~30 us of Python (a batch of 40,960 scalars took 15 s under cProfile, 4 s without
# streaming), while a batch of such rows kept until collate is small anyway.
STREAM_MIN_ROW_BYTES = 1 << 10


class Row:
    """Stands in a sample for a tensor already written to its batch row (found by ``path``)."""

    __slots__ = ("path", "pos")

    def __init__(self, path: Path, pos: int) -> None:
        self.path, self.pos = path, pos


def _is_namedtuple(obj: Any) -> bool:
    return contracts.is_namedtuple(obj)


def _leaves(obj: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    """(path, leaf) pairs through plain dicts, lists, tuples and namedtuples (what we can rebuild)."""
    if type(obj) is dict:
        return [pair for k, v in obj.items() for pair in _leaves(v, (*path, k))]
    if type(obj) in (list, tuple) or _is_namedtuple(obj):
        return [pair for i, v in enumerate(obj) for pair in _leaves(v, (*path, i))]
    return [(path, obj)]


def _replace(obj: Any, path: Path, new: Any) -> Any:
    """A copy of ``obj`` with the leaf at ``path`` replaced (containers copied, never mutated: the
    user's function may return objects it keeps)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if type(obj) is dict:
        out = dict(obj)
        out[head] = _replace(obj[head], rest, new)
        return out
    items = list(obj)
    items[head] = _replace(items[head], rest, new)
    if _is_namedtuple(obj):
        return type(obj)(*items)
    return tuple(items) if type(obj) is tuple else items


def _streamable(t: Any) -> bool:
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.requires_grad
        and t.numel() > 0
    )


class RowWriter:
    """Writes the tensors of the ``n`` samples of one batch into rows in a slot.

    Samples whose streamable tensors total fewer than ``min_row_bytes`` are not streamed (see
    STREAM_MIN_ROW_BYTES). ``reserve(nbytes) -> storage`` gives the slot's storage, grown to at least ``nbytes`` (called
    once, on the first sample, before anything is written). Thread-safe: decode threads call
    ``put`` as their samples finish.
    """

    def __init__(
        self,
        n: int,
        reserve: Callable[[int], torch.UntypedStorage],
        file: Callable[[], shm.SlotFile | None] | None = None,
        min_row_bytes: int = STREAM_MIN_ROW_BYTES,
    ) -> None:
        self.n = n
        self.min_row_bytes = min_row_bytes
        self._reserve = reserve
        self._file = file
        self.file: shm.SlotFile | None = None
        self._lock = threading.Lock()
        self.arena: shm.Arena | None = None
        self.buffers: dict[Path, torch.Tensor] = {}
        self._written: dict[int, Any] = {}  # pos -> the sample with Row placeholders
        self.active = True

    def put(self, pos: int, sample: Any) -> Any:
        """The sample with its streamed tensors replaced by ``Row`` placeholders (or unchanged)."""
        with self._lock:
            if not self.active:
                return sample
            leaves = [(p, t) for p, t in _leaves(sample) if _streamable(t)]
            if self.arena is None and not self._start(leaves):
                return sample
            if {p for p, _ in leaves} != set(self.buffers) or any(
                t.shape != self.buffers[p].shape[1:] or t.dtype != self.buffers[p].dtype for p, t in leaves
            ):
                self._stop()
                return sample
            for p, t in leaves:
                shm.write_row(self.buffers[p][pos], t, self.file)  # via the file: no faults
                sample = _replace(sample, p, Row(p, pos))
            self._written[pos] = sample
            return sample

    def _start(self, leaves: list[tuple[Path, torch.Tensor]]) -> bool:
        row_bytes = sum(t.numel() * t.element_size() for _, t in leaves)
        if not leaves or row_bytes < self.min_row_bytes:  # small rows: stacked once at collate
            self.active = False
            return False
        need = sum(-(-self.n * t.numel() * t.element_size() // shm.ALIGN) * shm.ALIGN for _, t in leaves)
        self.arena = shm.Arena(self._reserve(need + (64 << 10)))  # room for labels and other leaves
        self.file = self._file() if self._file is not None else None
        for p, t in leaves:
            buf = self.arena.alloc((self.n, *t.shape), t.dtype)
            if buf is None:  # cannot happen with the reservation above; stay correct regardless
                self._stop()
                return False
            self.buffers[p] = buf
        return True

    def _stop(self) -> None:
        """Give up streaming for this batch: samples written so far get their tensors back."""
        self.active = False
        for pos, sample in self._written.items():
            for p, buf in self.buffers.items():
                sample = _replace(sample, p, buf[pos].clone())
            self._written[pos] = sample
        self.buffers = {}

    def final(self, items: list[Any]) -> list[Any]:
        """The batch's items as they must be collated: with their tensors back if streaming stopped."""
        if self.active:
            return items
        return [self._written.get(pos, item) for pos, item in enumerate(items)]

    def collate_map(self, good_positions: list[int]) -> dict[type, Callable[..., Any]]:
        """Extra ``collate_fn_map`` entry turning the Row placeholders into the batch's tensors.

        Rows of dropped (failed) samples are closed up first, so the batch's rows are contiguous.
        """
        if not self.active or not self.buffers:
            return {}
        for k, pos in enumerate(good_positions):
            if k != pos:
                for buf in self.buffers.values():
                    buf[k].copy_(buf[pos])
        count = len(good_positions)
        views = {p: buf[:count] for p, buf in self.buffers.items()}

        def collate_rows(batch: list[Row], *, collate_fn_map: Any = None) -> torch.Tensor:
            return views[batch[0].path]

        return {Row: collate_rows}
