"""Concurrent reads of a remote sharded dataset inside one loader worker.

Why: ``ShardedDataset.get_many`` reads a batch's shards one after another, and opens each shard
it has not seen (its ``.idx`` and a size check: several requests) one after another under a single
lock. In block order a batch spans up to ``window`` shards, so over an object store (tens of ms per
request) a batch cost ``window`` round trips, and the first batch of every block ``window`` shard
opens in a row: the harness measured 300-440 ms spikes at each block boundary. Here the shards a
batch needs are opened concurrently, their reads run concurrently, and the worker's fetch thread
opens the shards of its queued tasks ahead of need (:meth:`ConcurrentShards.warm`).

Local datasets are not wrapped: their reads are page-cache copies where threads only add overhead.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

# Private parts of stallfree.shards.open.ShardedDataset used to open shards concurrently (its own
# open path serialises every shard open under one lock).
_NEEDED = ("locate", "shard_sizes", "get_many", "fs", "_open_reader", "_readers", "_open_lock", "_setup")


def wants_concurrency(dataset: Any) -> bool:
    """True for a remote (non-local filesystem) stallfree sharded dataset."""
    if not all(hasattr(type(dataset), n) or hasattr(dataset, n) for n in _NEEDED):
        return False
    from stallfree.shards.atomic import is_local

    try:
        return not is_local(dataset.fs)
    except Exception:  # noqa: BLE001 - an unreachable store: plain reads report the error
        return False


class ConcurrentShards:
    """Wraps a remote ``ShardedDataset``: ``get_many`` reads its shards concurrently and opens the
    missing ones concurrently first; other attributes are the dataset's."""

    def __init__(self, dataset: Any, threads: int = 8) -> None:
        self._ds = dataset
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="stallfree-shard")
        self._opening: dict[int, Any] = {}
        self._lock = threading.Lock()  # guards _opening (the fetch thread(s) and warm-ups share it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ds, name)

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> Any:
        return self._ds[index]

    def _check_process(self) -> None:
        ds = self._ds
        if getattr(ds, "_pid", os.getpid()) != os.getpid():
            ds._setup(None)  # forked: remote clients do not survive fork (what ds._reader does)
            with self._lock:
                self._opening.clear()

    def warm(self, shards: Sequence[int]) -> None:
        """Start opening ``shards`` (those not open or opening) in the background; returns at once."""
        self._check_process()
        ds = self._ds
        ds.fs  # noqa: B018 - resolve the filesystem once, before threads use it
        with self._lock:
            for s in dict.fromkeys(int(x) for x in shards):
                if ds._readers[s] is None and s not in self._opening:
                    self._opening[s] = self._pool.submit(self._open, s)

    def _open(self, s: int) -> None:
        ds = self._ds
        try:
            reader = ds._open_reader(s, getattr(ds, "verify_hashes", False))
        except Exception:  # noqa: BLE001 - the read itself opens it again and raises the real error
            logger.debug("opening shard %d ahead failed", s, exc_info=True)
            return
        with ds._open_lock:
            if ds._readers[s] is None:
                ds._readers[s] = reader
                return
        reader.close()

    def shards_of(self, indices: Sequence[int]) -> list[int]:
        return list(dict.fromkeys(self._ds.locate(int(i))[0] for i in indices))

    def get_many(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Samples for ``indices`` in order: one ``get_many`` per shard, run concurrently."""
        groups: dict[int, list[int]] = {}
        for pos, i in enumerate(indices):
            groups.setdefault(self._ds.locate(int(i))[0], []).append(pos)
        self.warm(list(groups))
        for s in groups:  # wait for the opens this batch needs (errors resurface in the reads)
            with self._lock:
                fut = self._opening.pop(s, None)
            if fut is not None:
                fut.result()
        if len(groups) <= 1:
            return list(self._ds.get_many(indices))
        parts = list(groups.values())
        futures = [self._pool.submit(self._ds.get_many, [indices[p] for p in ps]) for ps in parts]
        out: list[Any] = [None] * len(indices)
        for ps, fut in zip(parts, futures, strict=True):
            for p, sample in zip(ps, fut.result(), strict=True):
                out[p] = sample
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
