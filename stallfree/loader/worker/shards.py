"""Concurrent reads of a remote sharded dataset inside one loader worker.

Why: ``ShardedDataset.get_many`` reads a batch's shards one after another, and opens each shard
it has not seen (its ``.idx`` and a size check: several requests) one after another. In block
order a batch spans up to ``window`` shards, so over an object store (tens of ms per request) a
batch cost ``window`` round trips, and the first batch of every block ``window`` shard opens in a
row: the harness measured 300-440 ms spikes at each block boundary. Here each worker lends the
dataset a thread pool: the shards a batch needs are opened and read concurrently
(``get_many(indices, executor=)``), and the worker's fetch thread opens the shards of its queued
tasks ahead of need (``warm(shards, executor)``). Concurrency over shards is the shards package's
feature; this module only owns the pool and touches no private of the dataset (it once drove
``_open_reader``, ``_readers``, ``_open_lock``, ``_setup`` and ``_pid`` itself).

With ``staging`` (the loader's ``staging=`` option; on by default for block order) the wrapper
reads through ``shards.staged_reads.StagedShards`` instead: each shard is fetched whole, once
per node, into a local staging area, and its samples are read from there; ``warm`` then stages
the queued tasks' shards ahead of need.

Local datasets are not wrapped: their reads are page-cache copies where threads only add overhead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.utils.data

from stallfree.storage.daemon_pool import DaemonThreadPool
from stallfree.storage.staging import Staging, StagingDirError

logger = logging.getLogger(__name__)


class ConcurrentShards:
    """Wraps a remote ``ShardedDataset``: ``get_many`` reads its shards concurrently (opening the
    missing ones concurrently first) on this worker's pool; other attributes are the dataset's."""

    def __init__(self, dataset: Any, threads: int = 8, staging: Staging | None = None) -> None:
        self._ds = dataset
        # daemon threads: a read stuck on a slow server must not hold the process at exit
        self._pool = DaemonThreadPool(max(1, threads), thread_name_prefix="stallfree-shard")
        self._staged = None
        # a staging directory refused as unsafe: raised by each read, so that it reaches the
        # user as the error it is (raised here, in a worker's set-up, it was "worker exited")
        self._refused: StagingDirError | None = None
        if staging is not None:
            from stallfree.shards.staged_reads import StagedShards

            info = torch.utils.data.get_worker_info()  # a loader's workers share its windows
            share = (info.id, info.num_workers) if info is not None else None
            try:
                self._staged = StagedShards(dataset, staging, self._pool, share=share)
            except StagingDirError as exc:
                self._refused = exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ds, name)

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> Any:
        if self._refused is not None:
            raise self._refused
        if self._staged is not None:
            return self._staged.get_many([index])[0]
        return self._ds[index]

    def warm(self, shards: Sequence[int]) -> None:
        """Start opening (or staging) ``shards`` in the background; returns at once."""
        if self._refused is not None:
            return
        if self._staged is not None:
            self._staged.stage(shards)
        else:
            self._ds.warm(shards, self._pool)

    def prefetch(self, shards: Sequence[int]) -> None:
        """Stage (or open) ``shards``, needed later, once nothing needed now is on its way."""
        if self._refused is not None:
            return
        if self._staged is not None:
            self._staged.prefetch(shards)
        else:
            self._ds.warm(shards, self._pool)

    def shards_of(self, indices: Sequence[int]) -> list[int]:
        return self._ds.shards_of(indices)

    def get_many(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Samples for ``indices`` in order: one read per shard, run concurrently (or from
        staged copies)."""
        if self._refused is not None:
            raise self._refused
        if self._staged is not None:
            return self._staged.get_many(indices)
        return self._ds.get_many(indices, executor=self._pool)

    def close(self) -> None:
        if self._staged is not None:
            self._staged.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
