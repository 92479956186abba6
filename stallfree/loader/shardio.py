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
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.utils.data

from stallfree.loader import contracts
from stallfree.shards.staging import Staging

logger = logging.getLogger(__name__)


def wants_concurrency(dataset: Any) -> bool:
    """True for a remote (non-local filesystem) sharded dataset that reads shards concurrently."""
    if not isinstance(dataset, contracts.ConcurrentShardSource):
        return False
    try:
        return contracts.is_remote(dataset)
    except Exception:  # noqa: BLE001 - an unreachable store: plain reads report the error
        return False


class ConcurrentShards:
    """Wraps a remote ``ShardedDataset``: ``get_many`` reads its shards concurrently (opening the
    missing ones concurrently first) on this worker's pool; other attributes are the dataset's."""

    def __init__(self, dataset: Any, threads: int = 8, staging: Staging | None = None) -> None:
        self._ds = dataset
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="stallfree-shard")
        self._staged = None
        if staging is not None:
            from stallfree.shards.staged_reads import StagedShards

            info = torch.utils.data.get_worker_info()  # a loader's workers share its windows
            share = (info.id, info.num_workers) if info is not None else None
            self._staged = StagedShards(dataset, staging, self._pool, share=share)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ds, name)

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> Any:
        if self._staged is not None:
            return self._staged.get_many([index])[0]
        return self._ds[index]

    def warm(self, shards: Sequence[int]) -> None:
        """Start opening (or staging) ``shards`` in the background; returns at once."""
        if self._staged is not None:
            self._staged.stage(shards)
        else:
            self._ds.warm(shards, self._pool)

    def prefetch(self, shards: Sequence[int]) -> None:
        """Stage (or open) ``shards``, needed later, once nothing needed now is on its way."""
        if self._staged is not None:
            self._staged.prefetch(shards)
        else:
            self._ds.warm(shards, self._pool)

    def shards_of(self, indices: Sequence[int]) -> list[int]:
        return self._ds.shards_of(indices)

    def get_many(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Samples for ``indices`` in order: one read per shard, run concurrently (or from
        staged copies)."""
        if self._staged is not None:
            return self._staged.get_many(indices)
        return self._ds.get_many(indices, executor=self._pool)

    def close(self) -> None:
        if self._staged is not None:
            self._staged.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class LeadStaging:
    """The main process stages the first two windows of an epoch while its workers start.

    Why: a fresh worker's first request waits for its fork, its start-up and a new S3 client
    (~0.1-0.2 s at 10 ms each way, measured: RESULTS.md, Object storage), while the main process
    has a client that is already connected (it read the manifest). It starts the first window's
    downloads at once, and the next window's as soon as those are in (``then``): the workers'
    own look-ahead starts only once they have opened the first window's copies, which left the
    wire idle for ~0.17 s (measured: a request timeline, ``bench_s3_netns.py --timeline``). The
    workers' staging of these shards waits on the staging area's per-file lock and then opens
    the landed copies, so every shard is still fetched once per node. A hint only: what fails
    here is fetched (and its error raised) by the workers."""

    def __init__(
        self,
        dataset: Any,
        staging: Staging,
        shards: Sequence[int],
        then: Sequence[int] = (),
        threads: int = 8,
    ) -> None:
        from stallfree.shards.staged_reads import StagedShards

        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="stallfree-lead-stage")
        self._closed = False
        try:
            self._staged = StagedShards(dataset, staging, self._pool)
            first = self._staged.land(shards)
        except Exception:  # noqa: BLE001 - a hint: the workers stage what is missing themselves
            logger.debug("staging the first window in the main process failed", exc_info=True)
            return
        if not then:
            return
        left = [len(first)]
        lock = threading.Lock()

        def landed(_: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0] or self._closed:
                    return
            try:
                self._staged.land(then)
            except RuntimeError:  # closed meanwhile: the workers stage it themselves
                pass

        for fut in first:
            fut.add_done_callback(landed)

    def close(self) -> None:
        """Stop what has not started downloading (what has lands, staged for the next reader)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
