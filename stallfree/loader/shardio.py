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
from typing import Any

import torch.utils.data

from stallfree.loader import contracts
from stallfree.shards.daemon_pool import DaemonThreadPool
from stallfree.shards.staging import Staging, StagingDirError

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


class LeadStaging:
    """The main process stages the epoch's windows for its workers, one window ahead of the
    batches it dispatches.

    Why the main process: its client is connected already (it read the manifest), while a fresh
    worker's first request waits for its fork, its start-up and a new S3 client (~0.1-0.2 s at
    10 ms each way: RESULTS.md, Object storage). When the workers staged the next windows
    themselves, a worker took a shard's fetch lock before its client was ready, and that shard's
    GETs began ~0.16 s later than the main process could have begun them (a request timeline,
    ``bench_s3_netns.py --timeline``); each worker's client also cost ~0.1 CPU-s of the two cores
    the epoch ran on. Now the workers only open copies that have landed (waiting on the staging
    area's per-file lock while one is on its way) and fetch a shard themselves only where this
    failed, so every shard is still fetched once per node and its errors are raised in the
    worker that reads it.

    Order: the first window (``shards``) alone, so the first batch waits for as few bytes as
    possible; once it is in, ``then`` (the next window) and whatever ``ahead`` asked meanwhile;
    after that each ``ahead`` at once. The loader calls ``ahead`` with the next window's shards
    as it dispatches each batch (a shard is landed once), so staging runs one window ahead of
    dispatch and no further (bounded: the staging area holds about two windows a rank)."""

    def __init__(
        self,
        dataset: Any,
        staging: Staging,
        shards: Sequence[int],
        then: Sequence[int] = (),
        threads: int = 8,
    ) -> None:
        from stallfree.shards.staged_reads import StagedShards

        # daemon threads: a download stuck on a slow server must not hold the process at exit
        self._pool = DaemonThreadPool(max(1, threads), thread_name_prefix="stallfree-lead-stage")
        self._closed = False
        self._lock = threading.Lock()
        self._waiting: list[int] = list(then)  # asked for before the first window is in
        self._first_left = 0
        self._staged: StagedShards | None = None
        try:
            self._staged = StagedShards(dataset, staging, self._pool)
            first = self._staged.land(shards)
        except Exception:  # noqa: BLE001 - a hint: the workers stage what is missing themselves
            logger.debug("staging the first window in the main process failed", exc_info=True)
            self._staged = None
            return
        self._first_left = len(first)
        for fut in first:
            fut.add_done_callback(self._first_landed)
        if not first:
            self._first_landed(None)

    def _first_landed(self, _: Any) -> None:
        with self._lock:
            self._first_left = max(0, self._first_left - 1)
            if self._first_left or self._closed:
                return
            waiting, self._waiting = self._waiting, []
        self._land(waiting)

    def ahead(self, shards: Sequence[int]) -> bool:
        """Stage ``shards`` (the window after the one being dispatched) once the first window is
        in; each shard is landed once per epoch, whatever the number of calls. False where this
        stages nothing (its set-up failed, or it was closed): the workers stage ahead then."""
        with self._lock:
            if self._staged is None or self._closed:
                return False
            if self._first_left:
                self._waiting.extend(shards)
                return True
        self._land(shards)
        return True

    def _land(self, shards: Sequence[int]) -> None:
        if not shards or self._staged is None:
            return
        try:
            self._staged.land(shards)
        except RuntimeError:  # closed meanwhile: the workers stage what they need themselves
            pass

    def close(self) -> None:
        """Stop what has not started downloading (what has lands, staged for the next reader)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._staged is not None:
            self._staged.close()  # its directories let go once what is landing has landed
