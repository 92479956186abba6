"""The main process stages an epoch's first shard windows for its workers (``LeadStaging``).

Main-process side; the workers' side of staged reads is ``loader/worker/shards.py``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from stallfree.storage.daemon_pool import DaemonThreadPool
from stallfree.storage.staging import Staging

logger = logging.getLogger(__name__)


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
