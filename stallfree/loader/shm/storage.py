"""Batches across the process boundary through reusable shared-memory slots.

A worker collates straight into a slot (a shared ``UntypedStorage`` sent to the main process
once) and sends only a small description: the batch's structure with every tensor replaced by
``(offset, dtype, shape)``. The main process copies the tensors out (into pinned memory when
asked) and hands the slot back. No tensor is pickled; no shared-memory file is created per batch.

A slot's pages stay in shared memory while it is idle, but each process lets go of its own
mapping of them (``release_pages``) once it is done with the batch: a process's resident set then
holds only the batch it is filling or reading, not every slot it has touched (benchmarks/RESULTS.md,
"Loader": peak RSS of main + 2 workers went below torch's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stallfree.loader import _torch_compat as compat
from stallfree.loader import contracts

ALIGN = 64
STAGE_BYTES = 1 << 20  # rows are stacked privately in runs of up to this much, one write per run
PAGE = mmap.PAGESIZE
KEEP_MAPPED_BYTES = 4 << 20  # slots up to this size are not let go of (release_pages)
logger = logging.getLogger(__name__)


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


try:
    _DONTNEED: int | None = mmap.MADV_DONTNEED
except AttributeError:  # no madvise on this platform (Windows)
    _DONTNEED = None
_MADVISE = _madvise() if _DONTNEED is not None else None


def release_pages(storage: torch.UntypedStorage | None) -> bool:
    """Drop this process's mapping of a shared slot's pages; the data stays in shared memory.

    For a shared mapping MADV_DONTNEED only clears this process's page-table entries: the next
    touch maps the same page again (a minor fault), so nothing is lost and any other process
    mapping the slot is unaffected. Returns False where the platform has no madvise.

    Slots of at most ``KEEP_MAPPED_BYTES`` stay mapped: the next reader of a released page takes a
    fault per 4 KiB page (measured 2.6 us each here: 0.67 ms for a 1 MiB token batch that the
    training step reads, more than the loader spends on the batch), while keeping such a slot
    costs at most its own size of resident memory.
    """
    if storage is None:
        return False
    if storage.nbytes() <= KEEP_MAPPED_BYTES:
        return True
    return release_range(storage.data_ptr(), storage.nbytes())


def release_range(addr: int, nbytes: int) -> bool:
    """``release_pages`` for the whole pages inside ``[addr, addr + nbytes)`` of a shared mapping."""
    if _MADVISE is None:
        return False
    start = -(-addr // PAGE) * PAGE
    end = (addr + nbytes) // PAGE * PAGE
    if end <= start:
        return True
    if _MADVISE(start, end - start, _DONTNEED) != 0:
        logger.debug("madvise(MADV_DONTNEED) failed: errno %d", ctypes.get_errno())
        return False
    return True


try:
    _PWRITE: Callable[[int, Any, int], int] | None = os.pwrite
except AttributeError:  # not on Windows: slots are written through their mapping there
    _PWRITE = None


class SlotFile:
    """Writes into a slot through its shared-memory file (``pwrite``) instead of its mapping.

    A worker that fills a slot through its mapping takes a page fault per 4 KiB page every time
    the slot comes back (its pages were let go of, see ``release_pages``): ~4,700 faults for a
    batch of 32 ImageNet-sized float images. ``pwrite`` copies into the same shared pages from the
    kernel: no fault, nothing mapped, so nothing to let go of (benchmarks/bench_slotwrite.py: 7x
    less time per batch than writing through the released mapping).
    Only for storages shared by file descriptor (torch's default strategy on Linux); ``of``
    returns None otherwise and callers write through the mapping.
    """

    def __init__(self, fd: int, base: int, nbytes: int) -> None:
        self.fd, self.base, self.nbytes = fd, base, nbytes

    @classmethod
    def of(cls, storage: torch.UntypedStorage) -> SlotFile | None:
        import torch.multiprocessing as tmp

        if _PWRITE is None or tmp.get_sharing_strategy() != "file_descriptor":
            return None
        shared = compat.shared_fd(storage)
        if shared is None:
            return None
        fd, size = shared
        if size != storage.nbytes() or size < 8:
            return None
        slot = cls(fd, storage.data_ptr(), size)
        # The file's offset 0 must be the storage's first byte: check once, in the last 8 bytes.
        marker = os.urandom(8)
        view = torch.empty(0, dtype=torch.uint8).set_(storage)[size - 8 :]
        slot.write(size - 8, marker)
        return slot if bytes(view.numpy()) == marker else None

    def write(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = _PWRITE(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def write_tensor(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for a contiguous ``dst`` inside this slot, without mapping it."""
        if src.numel() != dst.numel() or not dst.is_contiguous():
            raise ValueError(f"cannot write {tuple(src.shape)} into {tuple(dst.shape)} (contiguous only)")
        flat = src.to(dst.dtype).contiguous().reshape(-1).view(torch.uint8)
        self.write(dst.data_ptr() - self.base, flat.numpy())


def write_row(dst: torch.Tensor, src: torch.Tensor, file: SlotFile | None) -> None:
    """Fill ``dst`` (a row of a slot) with ``src`` and leave it unmapped in this process: through
    the slot's file when there is one, else through the mapping, letting go of the row's pages."""
    if file is not None:
        file.write_tensor(dst, src)
    else:
        dst.copy_(src)
        release_range(dst.data_ptr(), dst.numel() * dst.element_size())


@dataclass(frozen=True)
class TensorRef:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    numpy: bool = False


# ``bytes`` leaves this big travel in the slot too; smaller ones are cheaper pickled
BYTES_IN_SLOT = 1024


@dataclass(frozen=True)
class BytesRef:
    """A ``bytes`` leaf of a batch (raw samples: encoded images, text) written into the slot.

    Why: a batch of bytes used to travel pickled through the result pipe (its description was
    the batch itself): 32 samples of 100 KB are 3.2 MB pushed through a 64 KB pipe buffer, and
    ``Connection._send``/``_recv`` were most of the worker's and the main process's CPU in a
    raw-bytes epoch (py-spy; RESULTS.md, Loader). The main process copies each out into a
    ``bytes`` of its own, so the slot is handed back at once."""

    offset: int
    nbytes: int


class Arena:
    """Bump allocator over one shared storage (a slot); tensors allocated here need no copy."""

    def __init__(self, storage: torch.UntypedStorage | None) -> None:
        self.storage = storage
        self.capacity = storage.nbytes() if storage is not None else 0
        self.base = storage.data_ptr() if storage is not None else 0
        self.used = 0
        self._bytes = torch.empty(0, dtype=torch.uint8)
        if storage is not None:
            self._bytes = torch.empty(0, dtype=torch.uint8).set_(storage)

    def alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = math.prod(shape) * dtype.itemsize
        start = self.alloc_offset(nbytes)
        if start is None:
            return None
        return self._bytes[start : start + nbytes].view(dtype).view(tuple(shape))

    def alloc_offset(self, nbytes: int) -> int | None:
        """Room for ``nbytes``: its offset from the slot's start, no tensor made (a ``bytes``
        leaf needs only where it goes: slicing and viewing a tensor per leaf cost about a third of
        what a 100 KB sample's write into the slot did; py-spy of a raw-bytes epoch)."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.capacity:
            return None
        self.used = start + nbytes
        return start

    def bytes_view(self, offset: int, nbytes: int) -> np.ndarray:
        """The slot's bytes ``offset`` .. ``offset + nbytes`` as a writable array (mapped)."""
        return self._bytes[offset : offset + nbytes].numpy()

    def owns(self, t: torch.Tensor) -> bool:
        return self.storage is not None and t.untyped_storage().data_ptr() == self.base


def _collate_tensor_into(arena: Arena, file: SlotFile | None = None) -> Callable[..., torch.Tensor]:
    def fn(batch: Sequence[torch.Tensor], *, collate_fn_map: Mapping | None = None) -> torch.Tensor:
        elem = batch[0]
        shape = (len(batch), *elem.shape)
        out = arena.alloc(shape, elem.dtype)
        if out is None or any(b.shape != elem.shape for b in batch):
            return torch.stack(list(batch), 0)
        if file is not None and all(b.dtype == elem.dtype and b.device.type == "cpu" for b in batch):
            # torch.stack(out=) without mapping the slot: rows are stacked privately in runs of
            # up to STAGE_BYTES and each run is one write (a write per 16 KiB row cost ~5 us of
            # Python each: 64 of them were most of a token batch's collate), big rows one by one
            row = elem.numel() * elem.element_size()
            per = max(1, STAGE_BYTES // max(row, 1)) if row < STAGE_BYTES else 1
            for i in range(0, len(batch), per):
                rows = batch[i : i + per]
                file.write_tensor(
                    out[i : i + len(rows)], rows[0] if len(rows) == 1 else torch.stack(list(rows), 0)
                )
            return out
        return torch.stack(list(batch), 0, out=out)

    return fn


def default_collate_into(
    batch: list[Any],
    arena: Arena,
    extra: Mapping[type, Callable] | None = None,
    file: SlotFile | None = None,
) -> Any:
    """torch's ``default_collate``, but stacking tensors straight into ``arena`` when they fit
    (through ``file`` when given: the slot is then never mapped by this process).

    ``extra``: more ``collate_fn_map`` entries, looked up first (rows already written: rows.py).
    """
    fn_map = {torch.Tensor: _collate_tensor_into(arena, file), **(extra or {})}
    return compat.collate_with(batch, fn_map)


def map_leaves(obj: Any, kinds: type | tuple[type, ...], leaf: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt with ``leaf(x)`` for every ``x`` of ``kinds`` inside its dicts, lists, tuples
    and namedtuples (the containers default_collate produces); everything else kept as is."""
    if isinstance(obj, kinds):
        return leaf(obj)
    if isinstance(obj, dict):
        return {k: map_leaves(v, kinds, leaf) for k, v in obj.items()}
    if contracts.is_namedtuple(obj):
        return type(obj)(*(map_leaves(v, kinds, leaf) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_leaves(v, kinds, leaf) for v in obj)
    return obj


def _walk(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    return map_leaves(obj, (torch.Tensor, np.ndarray, bytes), lambda x: _slotted(x, leaf))


def _slotted(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """``leaf(x)`` for what goes into a slot: arrays, and ``bytes`` (exactly) of BYTES_IN_SLOT
    or more; other leaves as they are."""
    if isinstance(x, bytes) and (type(x) is not bytes or len(x) < BYTES_IN_SLOT):
        return x
    return leaf(x)


def _nbytes(t: torch.Tensor | np.ndarray | bytes) -> int:
    if isinstance(t, bytes):
        return len(t)
    return int(t.nbytes) if isinstance(t, np.ndarray) else t.numel() * t.element_size()


def describe(batch: Any, arena: Arena, file: SlotFile | None = None) -> tuple[Any, int]:
    """Replace tensors by TensorRefs, copying any tensor not already in the arena into it (through
    ``file`` when given).

    Returns (description, bytes needed). When the arena is too small the description is None and
    the caller grows the slot to the returned size and calls again.
    """
    needed = [0]

    def count(t: Any) -> Any:
        needed[0] = -(-needed[0] // ALIGN) * ALIGN + _nbytes(t)
        return t

    _walk(batch, count)
    total = needed[0]

    def leaf(t: Any) -> Any:
        if isinstance(t, bytes):
            off = arena.alloc_offset(len(t))
            if off is None:
                raise _NoRoom
            if file is not None:
                file.write(arena.base + off - file.base, t)
            else:
                arena.bytes_view(off, len(t))[:] = np.frombuffer(t, np.uint8)
            return BytesRef(off, len(t))
        is_np = isinstance(t, np.ndarray)
        tt = torch.from_numpy(np.ascontiguousarray(t)) if is_np else t
        if not is_np and arena.owns(tt) and tt.is_contiguous():
            off = tt.data_ptr() - arena.base
            return TensorRef(off, _nbytes(tt), tt.dtype, tuple(tt.shape), False)
        dst = arena.alloc(tuple(tt.shape), tt.dtype)
        if dst is None:
            raise _NoRoom
        if file is not None and tt.device.type == "cpu":
            file.write_tensor(dst, tt)
        else:
            dst.copy_(tt)
        return TensorRef(dst.data_ptr() - arena.base, _nbytes(tt), tt.dtype, tuple(tt.shape), is_np)

    try:
        return _walk(batch, leaf), total
    except _NoRoom:
        return None, total + ALIGN * 64


class _NoRoom(Exception):
    pass


def described_bytes(desc: Any) -> int:
    """Bytes of tensor data a description stands for."""
    total = [0]

    def leaf(ref: Any) -> Any:
        if isinstance(ref, TensorRef | BytesRef):
            total[0] += ref.nbytes
        return ref

    _walk_refs(desc, leaf)
    return total[0]


class _Lease:
    """Keeps a slot's storage mapped while any tensor of its batch lives; hands it back after."""

    def __init__(self, storage: torch.UntypedStorage, release: Callable[[], None]) -> None:
        self.storage = storage
        self.release = release

    def __del__(self) -> None:
        try:  # never raise (nor print) from a finaliser: at interpreter exit module globals are gone
            self.release()
        except Exception:  # noqa: BLE001
            pass


class _View:
    """A numpy-visible window onto a leased slot (numpy keeps it as the array's base)."""

    def __init__(self, lease: _Lease, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.lease = lease
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr, "version": 3}


_TYPESTRS: dict[torch.dtype, str | None] = {}


def _typestr(dtype: torch.dtype) -> str | None:
    if dtype in _TYPESTRS:
        return _TYPESTRS[dtype]
    try:
        out: str | None = np.dtype(torch.empty((), dtype=dtype).numpy().dtype).str
    except (TypeError, RuntimeError):
        out = None  # bfloat16 and friends have no numpy twin: copied out instead
    _TYPESTRS[dtype] = out
    return out


def materialise(
    desc: Any, storage: torch.UntypedStorage, pin: bool = False, release: Callable[[], None] | None = None
) -> Any:
    """The batch a description stands for.

    With ``release`` (and no pinning) the tensors are zero-copy views of the slot and
    ``release()`` runs once the consumer has dropped all of them; otherwise they are copied out
    (into pinned memory when ``pin``) and ``release()`` runs at once.
    """
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    lease = _Lease(storage, release) if release is not None and not pin else None
    base = storage.data_ptr()

    def leaf(ref: Any) -> Any:
        if isinstance(ref, BytesRef):
            return raw[ref.offset : ref.offset + ref.nbytes].numpy().tobytes()
        if not isinstance(ref, TensorRef):
            return ref
        typestr = _typestr(ref.dtype) if lease is not None else None
        if typestr is not None:
            arr = np.asarray(_View(lease, base + ref.offset, ref.shape, typestr))
            return arr if ref.numpy else torch.from_numpy(arr)
        src = raw[ref.offset : ref.offset + ref.nbytes].view(ref.dtype).view(ref.shape)
        out = torch.empty(ref.shape, dtype=ref.dtype, pin_memory=pin)
        out.copy_(src)
        return out.numpy() if ref.numpy else out

    out = _walk_refs(desc, leaf)
    if lease is None and release is not None:
        release()
    return out


def _walk_refs(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    return map_leaves(obj, (TensorRef, BytesRef), leaf)
