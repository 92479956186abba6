"""A remote ``ShardedDataset`` read from node-local staged copies of its shards.

Why: in block order a batch takes a few rows of each shard of its window; read where they lie,
that is one ranged GET per sample (issue 20). Here the first read of a shard stages it whole
(``file_copy.copy_parts``: ranged GETs of ``Staging.part_bytes``, ``concurrency`` at once, written
into the staged file as they arrive, over presigned URLs on S3; its
sidecars beside it, fetched while it is, except a tar's ``.idx`` when the manifest records the
shard's digest: the index is then scanned from the checked copy, no request) into a
``staging.StagingArea`` shared by the node's processes, and its samples are read from the local
copy, with the checks a local shard gets (size, index against headers, member checksums). The dataset's order is never touched.

A staged shard is checked against the manifest before anyone reads it: size, and its digest where
the manifest records one (``stallfree shard`` does): xxh3-128, or sha256 in manifests written
before xxh3-128 was recorded. So an object rewritten after the dataset was written, or between
two of its parts, is a ``HashMismatchError`` naming it, not wrong data.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import posixpath
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import Any, BinaryIO

import fsspec

from stallfree.errors import HashMismatchError, MissingShardError
from stallfree.shards import formats
from stallfree.shards.formats import ShardOpen
from stallfree.storage import digests, file_copy, remote
from stallfree.storage.daemon_pool import DaemonThreadPool
from stallfree.storage.staging import Expected, StagedFile, Staging, StagingArea, StagingFullError

log = logging.getLogger(__name__)

# the staging directory's disk refusing a write: full, over quota, read-only, not ours
_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)

_LOCAL = fsspec.filesystem("file")


class _Open:
    """A shard's local reader and the pins that keep its staged files."""

    def __init__(self, reader: Any, pins: list[StagedFile]) -> None:
        self.reader, self.pins = reader, pins

    def close(self) -> None:
        self.reader.close()
        for p in self.pins:
            p.close()


class StagedShards:
    """Reads of ``dataset`` (a remote ``ShardedDataset``) served from staged shards.

    ``stage(shards)`` starts staging shards in the background (on ``executor``);
    ``get_many(indices)`` stages what it needs and waits for it. At most ``keep_open`` shards
    stay open (and pinned) per process; closed ones stay staged until the area needs room.

    ``share=(i, n)``: this is process ``i`` of ``n`` that read the same windows (a loader's
    workers): of the shards a batch needs, it fetches its ``n``-th first and takes the rest only
    then (by then usually staged by the others), so a window's downloads are spread over the
    processes instead of all landing on the one that got the window's first batch."""

    def __init__(
        self,
        dataset: Any,
        staging: Staging,
        executor: Executor,
        keep_open: int = 32,
        share: tuple[int, int] | None = None,
    ) -> None:
        self._format = formats.get_format(dataset.format, where=dataset.url)
        self.dataset = dataset
        self.staging = staging
        self.area = StagingArea(staging.resolved_root(), staging.cap_bytes)
        self.area.note(dataset.fingerprint, dataset.url)
        # after a fork the dataset's client is the parent's (not fork-safe): warm() renews it
        dataset.warm([], executor)
        # the client is made at the first request: in a loader's workers often never, the main
        # process stages their windows (loader/lead_staging.py)
        self._fs = dataset.fs
        self._namespace = dataset.fingerprint
        self._executor = executor
        # formats whose index can be rebuilt from a shard's own bytes (``indexable``: tar headers)
        self._derives_index = bool(self._format.indexable)
        # sidecars have a pool of their own: a shard's staging (on ``executor``) waits for them
        # (daemon threads: a download stuck on a slow server must not hold the process at exit)
        self._sidecars = DaemonThreadPool(4, thread_name_prefix="stallfree-sidecar")
        self._keep_open = max(1, keep_open)
        self._lock = threading.RLock()  # a done-callback may run in the thread that holds it
        self._open: OrderedDict[int, _Open] = OrderedDict()  # most recently used last
        self._pending: dict[int, Future] = {}
        self._needed: set[Future] = set()  # stagings a read asked for (not prefetches)
        self._later: dict[int, None] = {}  # prefetches waiting for the needed ones to finish
        self._theirs: dict[int, None] = {}  # needed, but the other processes' share: after ours
        self._share = share if share is not None and share[1] > 1 else None
        self._warned_disk = False
        self._warned_full = False
        self._unstageable: set[int] = set()  # shards the local disk refused: read remotely
        self._landing: set[int] = set()  # shards land() was asked for, once each
        # stagings running now: the area's directory descriptors and the sidecar pool are let go
        # once close() was called and none is left (closed under a running one, a descriptor's
        # number could be reused by another open, and that staging write into the wrong place)
        self._busy = 0
        self._closed = False

    def stage(self, shards: Sequence[int]) -> None:
        """Start staging (and opening) ``shards`` not open or on their way; returns at once."""
        with self._lock:
            new = [
                s
                for s in dict.fromkeys(int(x) for x in shards)
                if s not in self._open and s not in self._pending and s not in self._unstageable
            ]
            theirs = self._theirs_of(new)
            for s in new:
                self._later.pop(s, None)
                if s in theirs:
                    self._theirs[s] = None
                else:
                    self._theirs.pop(s, None)
                    self._submit(s, needed=True)
            self._start_later()

    def _theirs_of(self, shards: list[int]) -> set[int]:
        """Of ``shards``, those the other processes of the share fetch first."""
        if self._share is None:
            return set()
        i, n = self._share
        ordered = sorted(shards)
        return set(ordered) - set(ordered[i::n])

    def prefetch(self, shards: Sequence[int]) -> None:
        """Stage ``shards`` (the next window's) once every shard a read is waiting for is in:
        started at once they would share the bandwidth with those and delay the current batch.
        Of a share, only this process's part: the others prefetch theirs (a window fetched by
        one worker took 0.37 s where its first, split, took 0.28 s for more bytes); a shard
        another one never fetched is fetched here when a read needs it."""
        with self._lock:
            new = [
                s
                for s in dict.fromkeys(int(x) for x in shards)
                if s not in self._open and s not in self._pending and s not in self._unstageable
            ]
            theirs = self._theirs_of(new)
            for s in new:
                if s not in theirs:
                    self._later[s] = None
            self._start_later()

    def _submit(self, s: int, needed: bool) -> Future:
        """Under the lock: stage ``s`` on the pool."""
        fut = self._pending[s] = self._executor.submit(self._guarded, self._prepare, s)
        if needed:
            self._needed.add(fut)
            fut.add_done_callback(self._needed_done)
        return fut

    def _needed_done(self, fut: Future) -> None:
        with self._lock:
            self._needed.discard(fut)
            self._start_later()

    def _start_later(self) -> None:
        """Under the lock: once no needed staging of ours is left, start the others' share of
        what is needed (by then staged by them, or on its way: mostly a wait and an open) and
        the waiting prefetches together. Prefetches once waited for the others' share to be
        open as well, and the wire idled ~0.2 s at every window's end meanwhile (a request
        timeline of ``bench_s3_netns.py --timeline``)."""
        if self._needed:
            return
        theirs, self._theirs = list(self._theirs), {}
        later, self._later = list(self._later), {}
        for s in theirs:  # (a done callback may run _start_later again inside _submit)
            if s not in self._open and s not in self._pending:
                self._submit(s, needed=True)
        for s in later:
            if s not in self._open and s not in self._pending:
                self._submit(s, needed=False)

    def _wait(self, s: int) -> Any:
        """Shard ``s``'s open reader (staging it first if need be)."""
        with self._lock:
            opened = self._open.get(s)
            if opened is not None:
                self._open.move_to_end(s)
                return opened.reader
            fut = self._pending.get(s)
            if fut is None:
                self._later.pop(s, None)
                self._theirs.pop(s, None)
                fut = self._submit(s, needed=True)
        try:
            opened = fut.result()
        finally:
            with self._lock:
                if self._pending.get(s) is fut:
                    del self._pending[s]
        with self._lock:
            current = self._open.setdefault(s, opened)
            self._open.move_to_end(s)
            while len(self._open) > self._keep_open:
                _, old = self._open.popitem(last=False)
                if old is not current:
                    old.close()
        if current is not opened:
            opened.close()
        return current.reader

    def get_many(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Samples for ``indices`` in order, each shard staged once and read locally."""
        by_shard: dict[int, tuple[list[int], list[int]]] = {}
        for pos, index in enumerate(indices):
            s, row = self.dataset.locate(index)
            positions, rows = by_shard.setdefault(s, ([], []))
            positions.append(pos)
            rows.append(row)
        self.stage(list(by_shard))
        with self._lock:  # ours first: the others' share is started once ours is in
            shards = sorted(by_shard, key=lambda s: s in self._theirs)
        out: list[Any] = [None] * len(indices)
        for s in shards:
            positions, rows = by_shard[s]
            if s in self._unstageable:
                samples = self.dataset.get_many([indices[p] for p in positions])
                for pos, sample in zip(positions, samples, strict=True):
                    out[pos] = sample
                continue
            try:
                samples = self._read_staged(s, rows, keep=by_shard)
            except OSError as exc:  # the local disk, not the store (whose errors are ShardErrors)
                if exc.errno not in _DISK_ERRORS:
                    raise
                self._unstaged(s, exc)
                samples = None
            if samples is None:
                samples = self.dataset.get_many([indices[p] for p in positions])
            for pos, sample in zip(positions, samples, strict=True):
                out[pos] = sample
        return out

    def _read_staged(self, s: int, rows: list[int], keep: Any) -> list[dict[str, Any]] | None:
        """Shard ``s``'s ``rows`` from its staged copy; None when the cap leaves no room for it
        (the files in use fill it): read remotely then. Before giving up, this process lets go
        of the copies it keeps open but this batch does not read, and tries once more."""
        try:
            return self._wait(s).get_many(rows)
        except StagingFullError as exc:
            full = exc
        if self._release_idle(keep):
            try:
                return self._wait(s).get_many(rows)
            except StagingFullError as exc:
                full = exc
        if not self._warned_full:
            self._warned_full = True
            log.warning(
                "%s: reading shards that do not fit with ranged GETs (about one per sample) instead; "
                "raise the cap (staging=Staging(cap_bytes=...)) to at least two shard windows",
                full,
            )
        return None

    def _release_idle(self, keep: Any) -> bool:
        """Close the open copies not in ``keep`` (their pins go: evictable); True if any."""
        with self._lock:
            idle = [s for s in self._open if s not in keep]
            closing = [self._open.pop(s) for s in idle]
        for o in closing:
            o.close()
        return bool(closing)

    def _unstaged(self, s: int, exc: OSError) -> None:
        """Staging failed on the local disk (full, read-only): say so once, read remotely."""
        with self._lock:
            self._unstageable.add(s)
        if not self._warned_disk:
            self._warned_disk = True
            log.warning(
                "staging %s in %s failed (%s): reading unstaged shards with ranged GETs (about one "
                "per sample) instead; free space there or pass staging=Staging(root=..., cap_bytes=...)",
                self.dataset.manifest.shards[s].path,
                self.area.root,
                exc,
            )

    def land(self, shards: Sequence[int]) -> list[Future]:
        """Start staging ``shards``' files for other processes of the node, opening nothing and
        keeping no pin (the main process fetching a first window while its workers start);
        returns at once, with a future per shard not asked for before, done once it has landed
        or failed. A failure is left for the process that reads the shard to meet."""
        with self._lock:
            new = [s for s in dict.fromkeys(int(x) for x in shards) if s not in self._landing]
            self._landing.update(new)
        # already staged (a warm epoch): nothing to do, and no thread woken for it; one evicted
        # before it is read is fetched by its reader
        new = [s for s in new if not os.path.exists(self._staged_path(s))]
        return [self._executor.submit(self._guarded, self._land, s) for s in new]

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` counted as running (see ``_busy``); refused once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("StagedShards is closed")
            self._busy += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._busy -= 1
                last = self._closed and self._busy == 0
            if last:
                self._release()

    def _release(self) -> None:
        self._sidecars.shutdown(wait=False, cancel_futures=True)
        self.area.close()

    def _staged_path(self, s: int) -> str:
        return self.area.path_of(self._namespace, self.dataset.manifest.shards[s].path)

    def _land(self, s: int) -> None:
        try:
            self._prepare(s, open_copy=False)
        except Exception:  # noqa: BLE001 - the reader's own staging raises it, where it counts
            log.debug("staging shard %d ahead for the node failed", s, exc_info=True)

    def _prepare(self, s: int, open_copy: bool = True) -> _Open | None:
        """Stage shard ``s`` and its sidecars, open the local copy (or, without ``open_copy``,
        release the staged files and return None)."""
        ds = self.dataset
        info = ds.manifest.shards[s]
        path = ds.shard_path(s)
        pins: list[StagedFile] = []
        wanted = self._format.sidecars(path, with_checksums=bool(ds.verify_samples))
        if (info.sha256 or info.xxh3_128) and self._derives_index:
            # the copy is checked against the manifest's digest, so an index scanned from it is
            # as good as the stored one, and costs no request (a tar's headers: ~1 ms locally)
            indexes = set(self._format.sidecars(path, with_checksums=False))
            wanted = [side for side in wanted if side not in indexes]
        # the sidecars left (checksums) are fetched while the shard is: after it, each cost one
        # more round trip before the shard's first row could be read (50-100 ms at 10 ms each way)
        sides = [self._sidecars.submit(self._stage_sidecar, side, info.path) for side in wanted]
        try:
            main = self.area.stage(
                self._namespace,
                info.path,
                lambda f: self._fetch_shard(path, info, f),
                size=info.bytes,
                expect=_expected(info),
            )
            pins.append(main)
            for fut in sides:
                staged = fut.result()
                if staged is not None:
                    pins.append(staged)
            if not open_copy:
                for p in pins:
                    p.close()
                return None
            index = None
            if len(wanted) < len(self._format.sidecars(path, with_checksums=bool(ds.verify_samples))):
                index = self._local_index(main.path, info)
                if index is None:  # the format's scan gave none after all: stage the stored one
                    for side in indexes:
                        staged = self._stage_sidecar(side, info.path)
                        if staged is not None:
                            pins.append(staged)
            request = ShardOpen(_LOCAL, main.path, info, index=index, verify_samples=bool(ds.verify_samples))
            reader = self._format.open_reader(request)
        except BaseException:
            for fut in sides:  # every sidecar's pin, also those staged after the failure
                try:
                    staged = fut.result()
                except BaseException:  # noqa: BLE001 - the first failure is the one raised
                    staged = None
                if staged is not None and staged not in pins:
                    pins.append(staged)
            for p in pins:
                p.close()
            raise
        return _Open(reader, pins)

    def _local_index(self, local_path: str, info: Any) -> Any:
        """The staged copy's index, scanned from its own bytes (``Format.scan``); None where the
        format keeps none (its reader then reads what it needs from the copy)."""
        scanned = self._format.scan(_LOCAL, posixpath.dirname(local_path), [local_path])
        return scanned.indices[0] if scanned.indices else None

    def _stage_sidecar(self, side: str, shard: str) -> StagedFile | None:
        """Stage one sidecar beside the shard's copy, under its own name, where the format's
        reader looks for it; None if the store has none (the local reader says what a missing
        one means: tar, no .idx, scan headers)."""
        name = posixpath.join(posixpath.dirname(shard), posixpath.basename(side))
        try:
            return self.area.stage(self._namespace, name, produce=lambda: self._fetch_small(side, shard))
        except MissingShardError:
            return None

    def _fetch_shard(self, path: str, info: Any, f: BinaryIO) -> None:
        """Shard bytes from the store into ``f``, checked against the manifest's size and digest:
        its xxh3-128 where it records one (a seventh of sha256's CPU per byte: ``digests.py``),
        else its sha256. The digest is taken from the written file (parts land in any order)."""
        fs = self._fs
        file_copy.copy_parts(
            fs,
            path,
            info.bytes,
            f.fileno(),
            shard=info.path,
            part_bytes=self.staging.part_bytes,
            concurrency=self.staging.concurrency,
            direct=self.staging.direct,
        )
        if info.xxh3_128:
            name, want, digest = "xxh3-128", info.xxh3_128, digests.fast_hasher()
        elif info.sha256:
            name, want, digest = "sha256", info.sha256, hashlib.sha256()
        else:
            log.debug("staged %s (%d bytes, no digest recorded)", info.path, info.bytes)
            return
        got = digests.update_from_fd(digest, f.fileno(), info.bytes)
        if digest.hexdigest() != want:
            raise HashMismatchError(
                f"{remote.describe(fs, path)} changed: {name} of the {got} bytes read is {digest.hexdigest()}, "
                f"the manifest records {want} (the object was rewritten after the dataset was "
                "written, or while it was read)",
                shard=info.path,
            )
        log.debug("staged %s (%d bytes)", info.path, got)

    def _fetch_small(self, path: str, shard: str) -> bytes:
        return remote.read_file(self._fs, path, shard=shard)

    def close(self) -> None:
        """Close the open copies, and those still being staged once they are (their pins
        released: the files stay staged for the next reader)."""
        with self._lock:
            opened, self._open = list(self._open.values()), OrderedDict()
            pending, self._pending = list(self._pending.values()), {}
            idle, self._closed = self._busy == 0 and not self._closed, True
        for o in opened:
            o.close()
        for fut in pending:
            fut.add_done_callback(_close_result)
        if idle:  # else the last staging running lets them go
            self._release()


def _expected(info: Any) -> Expected:
    """What a staged copy of the shard ``info`` must be: its size, and its xxh3-128 (else its
    sha256) where the manifest records one."""
    if info.xxh3_128:
        return Expected(info.bytes, "xxh3-128", info.xxh3_128)
    if info.sha256:
        return Expected(info.bytes, "sha256", info.sha256)
    return Expected(info.bytes)


def _close_result(fut: Future) -> None:
    """A staging's opened copy, closed once nobody will read it (a failed one holds nothing)."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


__all__ = ["StagedShards"]
