"""Whole remote files copied into an open local file, in large ranged reads: what staging fetches.

Why its own module: staging moves hundreds of MB a cold epoch, and on a CPU-bound node how each
byte is received matters (``benchmarks/bench_s3_clients.py --parts``). S3 through s3fs takes the
direct route where it can (``s3direct.py``: presigned GETs received with ``readinto`` straight
into the file); everything else goes through ``remote.read_parts``. Every part is checked and
retried by ``remote``'s one primitive either way, so the errors a user meets are the same.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from concurrent.futures import wait

import fsspec

from stallfree.storage import remote, s3direct
from stallfree.storage.daemon_pool import DaemonThreadPool

log = logging.getLogger(__name__)


def copy_parts(
    fs: fsspec.AbstractFileSystem,
    path: str,
    size: int,
    fd: int,
    *,
    shard: str,
    part_bytes: int = remote.PART_BYTES,
    concurrency: int = remote.PART_CONCURRENCY,
    policy: remote.RetryPolicy | None = None,
    direct: bool = True,
) -> None:
    """A whole file of ``size`` bytes written to the open file ``fd`` at the same offsets, in
    ``part_bytes`` ranged reads, ``concurrency`` at once, each checked and retried like every
    remote read (``remote``; a part asked again is written again whole). Returns once every part
    is written; on an error, once no part is being written any more, so the caller may close
    ``fd``.

    S3 through s3fs (where ``direct`` and ``s3direct.route_for`` allow): presigned GETs received
    straight into the file (``s3direct.py``; see RESULTS.md, Object storage, for the CPU it
    saves). Refused there (a redirect, 400 or 403: a bucket in another region, a policy that
    denies presigned URLs), the file is read again through the filesystem's client, and so is
    every later one. Any other filesystem: ``read_parts``, each part written."""
    if part_bytes < 1 or concurrency < 1:
        raise ValueError(f"part_bytes and concurrency must be >= 1, got {part_bytes}, {concurrency}")
    route = _direct_route(fs) if direct else None
    if route is not None:
        try:
            _copy_direct(route, path, size, fd, shard, part_bytes, concurrency, policy)
            return
        except s3direct.RouteRefused as exc:  # e.g. a bucket policy that denies presigned URLs
            _refuse_route(fs, path, exc)
    for start, data in remote.read_parts(
        fs, path, size, shard=shard, part_bytes=part_bytes, concurrency=concurrency, policy=policy
    ):
        s3direct.pwrite_all(fd, memoryview(data), start)


def _copy_direct(
    route: s3direct.DirectRoute,
    path: str,
    size: int,
    fd: int,
    shard: str,
    part_bytes: int,
    concurrency: int,
    policy: remote.RetryPolicy | None,
) -> None:
    parts = [(s, min(size, s + part_bytes)) for s in range(0, size, part_bytes)]
    pool = _part_pool()
    for first in range(0, len(parts), concurrency):
        group = parts[first : first + concurrency]
        futures = [
            pool.submit(copy_part, route, path, a, b, fd, shard=shard, policy=policy) for a, b in group[1:]
        ]
        try:
            copy_part(route, path, *group[0], fd, shard=shard, policy=policy)  # this thread reads one
        finally:
            wait(futures)  # none may write to ``fd`` after the caller was told it failed
        for fut in futures:
            fut.result()


def _refuse_route(fs: fsspec.AbstractFileSystem, path: str, exc: BaseException) -> None:
    """Read through the filesystem's own client from now on, and say why once."""
    with _ROUTES_LOCK:
        _ROUTES[id(fs)] = (os.getpid(), None)
    log.warning(
        "%s: presigned GETs refused (%s); reading shards through %s instead",
        remote.describe(fs, path),
        exc,
        type(fs).__name__,
    )


def copy_part(
    route: s3direct.DirectRoute,
    path: str,
    start: int,
    end: int,
    fd: int,
    *,
    shard: str,
    policy: remote.RetryPolicy | None = None,
) -> None:
    """Bytes ``[start, end)`` of ``path`` through ``route`` into ``fd`` at the same offsets:
    the length checked, a short or failed part asked again (``RetryPolicy``), then
    ``RemoteReadError`` naming URL, shard and range; a local write error raised as it is."""
    try:
        remote.read_with_retries(
            route.fs, path, start, end, shard=shard, policy=policy,
            fetch=lambda deadline_at: route.copy_range(path, start, end, fd, deadline_at),
        )  # fmt: skip
    except s3direct.LocalWriteError as exc:  # the local disk's own error (full: the caller reads remotely)
        raise exc.__cause__ from None


# id(fs) -> (pid, the route or None): by identity, not fsspec's equality (a filesystem made again
# after a fork equals the parent's, whose client must not be used in the child); an entry goes
# with its filesystem
_ROUTES: dict[int, tuple[int, s3direct.DirectRoute | None]] = {}
_ROUTES_LOCK = threading.Lock()
_PART_POOL: tuple[int, DaemonThreadPool] | None = None  # (pid, this process's pool)


def _renew_locks_after_fork() -> None:
    """A fork while another thread held ``_ROUTES_LOCK`` would leave it locked in the child."""
    global _ROUTES_LOCK
    _ROUTES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_renew_locks_after_fork)
PART_THREADS = 16  # parts read at once by one process, over all its shards (8 shards of 2 parts)


def _direct_route(fs: fsspec.AbstractFileSystem) -> s3direct.DirectRoute | None:
    """``fs``'s direct route (made once per filesystem and process), None where it has none."""
    key, pid = id(fs), os.getpid()
    with _ROUTES_LOCK:
        got = _ROUTES.get(key)
        if got is not None and got[0] == pid and (got[1] is None or got[1].serves(fs)):
            return got[1]
    config = getattr(fs, "config_kwargs", None) or {}
    route = s3direct.route_for(
        fs,
        connect_s=float(config.get("connect_timeout", remote.DEFAULT_TIMEOUTS.connect_s)),
        read_s=float(config.get("read_timeout", remote.DEFAULT_TIMEOUTS.read_s)),
    )
    try:
        weakref.finalize(fs, _ROUTES.pop, key, None)
    except TypeError:  # not weakly referable: not kept, asked again next time
        return route
    with _ROUTES_LOCK:
        _ROUTES[key] = (pid, route)
    return route


def _part_pool() -> DaemonThreadPool:
    """This process's threads for parts beyond the first of each group (made again after a
    fork: a pool's threads do not survive one). Daemon threads: a part still downloading when
    the process exits is abandoned, not waited for (``daemon_pool.py``)."""
    global _PART_POOL
    with _ROUTES_LOCK:
        if _PART_POOL is None or _PART_POOL[0] != os.getpid():
            _PART_POOL = (os.getpid(), DaemonThreadPool(PART_THREADS, thread_name_prefix="stallfree-part"))
        return _PART_POOL[1]


__all__ = ["PART_THREADS", "copy_part", "copy_parts"]
