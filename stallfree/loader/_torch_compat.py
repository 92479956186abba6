"""Every use of torch's private data-loading internals, in one place.

The loader promises torch's DataLoader behaviour, and a few of torch's behaviours are only
reachable through private names: the worker info that ``torch.utils.data.get_worker_info()``
returns, the numpy seed torch gives each worker, the exception wrapper that carries a worker's
traceback, collate's type dispatch table, shared-memory storages. Each is used here only, with
why, and with a fallback where a future torch might drop the name; nothing else in stallfree
imports a private torch module (tests/test_imports.py checks this).

Tested on the torch versions CI runs (see pyproject.toml); the fallbacks keep the loader working,
with torch's exact messages or seeds where torch offers no public equivalent.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

logger = logging.getLogger(__name__)

# -- collate -------------------------------------------------------------------------------
# Why: our default collate writes tensors straight into a shared slot, so it must be torch's own
# collate with one entry of its type table replaced; torch exports only ``default_collate``.
try:
    from torch.utils.data._utils.collate import collate, default_collate_fn_map
except ImportError:  # pragma: no cover - no such torch yet; fall back to plain default_collate
    collate = None
    default_collate_fn_map = {}


def collate_with(batch: list[Any], fn_map: Mapping[type, Callable[..., Any]]) -> Any:
    """torch's ``default_collate`` with ``fn_map`` entries looked up first."""
    if collate is None:  # pragma: no cover - see the import above
        return tud.default_collate(batch)
    table = dict(fn_map)
    for k, v in default_collate_fn_map.items():
        table.setdefault(k, v)
    return collate(batch, collate_fn_map=table)


# -- worker info and seeds -------------------------------------------------------------------
try:
    from torch.utils.data._utils import worker as _torch_worker
except ImportError:  # pragma: no cover
    _torch_worker = None


def set_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer inside our worker as in torch's.

    Why private: torch offers only the getter; user datasets (and IterableDataset sharding) call
    it, so our workers must set the same module global torch's own workers set."""
    if _torch_worker is None:  # pragma: no cover
        logger.warning("this torch has no worker-info module: get_worker_info() returns None in workers")
        return
    _torch_worker._worker_info = _torch_worker.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
    )


def get_worker_info() -> Any:
    return tud.get_worker_info()


def _seed_sequence_state(base_seed: int, worker_id: int) -> list[int]:
    """A 4 x 32-bit numpy seed from (base_seed, worker id) through numpy's SeedSequence (torch's own
    rule is a re-implementation of SeedSequence's hashing; this is close, not bit-identical)."""
    entropy = [worker_id, base_seed & 0xFFFFFFFF, base_seed >> 32]
    return [int(x) for x in np.random.SeedSequence(entropy).generate_state(4)]


def worker_numpy_seed(base_seed: int, worker_id: int) -> Any:
    """The numpy seed torch's workers get (so numpy randomness in user datasets matches torch's)."""
    gen = getattr(_torch_worker, "_generate_state", None)
    if gen is not None:
        return gen(base_seed, worker_id)
    return _seed_sequence_state(base_seed, worker_id)  # pragma: no cover


# -- worker exceptions -----------------------------------------------------------------------
try:
    from torch._utils import ExceptionWrapper as _ExceptionWrapper
except ImportError:  # pragma: no cover
    _ExceptionWrapper = None


class _OwnExceptionWrapper:
    """Stand-in for torch's ExceptionWrapper: the exception type and the worker's traceback text."""

    def __init__(self, exc_info: tuple, where: str) -> None:
        self.exc_type = exc_info[0]
        self.exc_msg = "".join(traceback.format_exception(*exc_info))
        self.where = where

    def reraise(self) -> None:
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        try:
            exc = self.exc_type(msg)
        except Exception:  # noqa: BLE001 - a type that needs other arguments
            raise RuntimeError(msg) from None
        raise exc


def wrap_exception(exc: BaseException, where: str) -> Any:
    """A picklable carrier of ``exc`` and its traceback; ``.reraise()`` raises it in the main
    process with torch's message ("Caught X in DataLoader worker process N. Original Traceback")."""
    cls = _ExceptionWrapper or _OwnExceptionWrapper
    return cls(exc_info=(type(exc), exc, exc.__traceback__), where=where)


def is_exception_wrapper(obj: Any) -> bool:
    cls = _ExceptionWrapper or _OwnExceptionWrapper
    return isinstance(obj, cls)


# -- shared memory ---------------------------------------------------------------------------
def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """A shared-memory storage of ``nbytes`` made directly (no tensor first).

    Why private: ``UntypedStorage._new_shared`` allocates the shared segment at once; the public
    route (a tensor's ``share_memory_()``) allocates private memory and copies it over."""
    make = getattr(torch.UntypedStorage, "_new_shared", None)
    if make is not None:
        return make(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8).share_memory_().untyped_storage()  # pragma: no cover


def shared_fd(storage: torch.UntypedStorage) -> tuple[int, int] | None:
    """(file descriptor, size) of a storage shared by file descriptor, or None.

    Why private: writing a slot through its file (``pwrite``) instead of its mapping saves a page
    fault per 4 KiB (loader/shm/storage.py); torch exposes the descriptor only through this method."""
    fn = getattr(storage, "_share_fd_cpu_", None)
    if fn is None:
        return None
    try:
        fd, size = fn()
    except (RuntimeError, AttributeError):
        return None
    return int(fd), int(size)


def shared_storage_of_fd(fd: int, nbytes: int) -> torch.UntypedStorage:
    """A shared-memory storage over the first ``nbytes`` of the file ``fd`` (the storage keeps
    its own duplicate; the caller still closes ``fd``).

    Why private: a worker's slot segment arrives as a bare descriptor (loader/shm/segments.py);
    ``_new_shared_fd_cpu`` is what torch's own storage unpickling builds it with, so the storage
    is the same kind as one that came pickled."""
    return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)


SHM_DIR = "/dev/shm"


def remove_leftover_segments(pids: list[int], shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the shared-memory names that processes ``pids`` (exited) left behind; returns them.

    Why private: torch names each segment it makes ``/torch_<pid>_<random>_<counter>`` and, under
    the ``file_descriptor`` strategy, unlinks the name right after ``shm_open``, ``ftruncate``
    and ``mmap``. A worker terminated inside that window (an iterator dropped mid-epoch ends its
    workers at once, maybe while one grows a slot) leaves the name, and its memory, in
    ``/dev/shm`` until reboot (measured: 2 in 50 drops with 4 MiB batches). Once the worker is
    gone no process can still be using such a name: every segment travels by descriptor. Under
    the ``file_system`` strategy names live on by design (torch's shm manager frees them), so
    nothing is touched; a torch that names segments otherwise just matches nothing."""
    import os

    import torch.multiprocessing as tmp

    if not pids or tmp.get_sharing_strategy() != "file_descriptor":
        return []
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(prefixes)]
    except OSError:  # no /dev/shm here (not Linux): nothing to sweep
        return []
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


# -- DataLoader internals ----------------------------------------------------------------------
def auto_collation(loader: tud.DataLoader) -> bool:
    """Whether torch batches samples for this loader (a batch sampler is set): torch's rule."""
    value = getattr(loader, "_auto_collation", None)
    return bool(loader.batch_sampler is not None) if value is None else bool(value)


def index_sampler(loader: tud.DataLoader) -> Any:
    """What torch's iterator draws indices from: the batch sampler when batching, else the sampler."""
    value = getattr(loader, "_index_sampler", None)
    if value is not None:
        return value
    return loader.batch_sampler if auto_collation(loader) else loader.sampler  # pragma: no cover


def set_iterator_timeout(iterator: Any, seconds: float) -> None:
    """Bound each wait of torch's own multi-process iterator (used for IterableDatasets): a hung
    worker becomes torch's "DataLoader timed out" error instead of a hang. Why private: torch reads
    the timeout only from this attribute, set from the loader's ``timeout`` at construction."""
    if hasattr(iterator, "_timeout"):
        iterator._timeout = seconds


def shutdown_persistent_workers(loader: tud.DataLoader) -> None:
    """Stop the workers a torch DataLoader keeps between epochs (``persistent_workers``) now.
    Why private: torch keeps that iterator only as ``loader._iterator`` and ends its workers when
    the loader is garbage collected; a benchmark comparing loaders must end them before the next."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shutdown_torch_iterator(iterator)


def shutdown_torch_iterator(iterator: Any) -> None:
    """Stop a torch iterator's worker processes now (torch otherwise waits for the iterator's GC)."""
    fn = getattr(iterator, "_shutdown_workers", None)
    if fn is not None:
        fn()
