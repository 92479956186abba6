"""The one primitive for remote reads: ``read_range`` / ``read_ranges`` / ``read_file``.

Why one: a ranged read over HTTP or S3 can return fewer bytes than asked and say nothing (an
object re-uploaded shorter during a run; a server, proxy or cache that truncates bodies but sends a
matching ``Content-Length``), and fsspec hands those bytes back as if they were the range. Each
reader used to call ``cat_file`` on its own and most never compared the length, so a short body
became a sample (issue 18: 1,632 of 2,000 samples wrong, no error). Every remote read in
``shards/`` (tar ranges, ``.idx``, manifest, Arrow batches, the tar walker) and in ``tokens/`` goes
through here, so the check, the retries and the error wording exist once.

What a read does: ask once; a short body, a transport failure (connection refused or reset, a
timeout, a 5xx) is asked again up to ``RetryPolicy.attempts`` times in all with exponential
backoff; then ``RemoteReadError`` naming the URL (and endpoint), shard, sample key where known,
asked range and returned length. Not retried, because asking again cannot help: a missing file
(``MissingShardError``), a refusal (``ShardReadError``, access denied), a body *longer* than asked
(the server ignores ``Range``; the bytes at the asked offset are not known).

Bounded time: ``with_timeouts`` fills in connect/read timeouts (``Timeouts``: 5 s / 15 s) for
s3fs and fsspec's HTTP client where the user gave none, and turns botocore's own retries off;
a failure the client already retried (s3fs tries 5 times, ~1 s of backoff, for read timeouts and
dropped connections) is not retried again. With the defaults a read fails, naming the endpoint,
after: ~0.3 s when connections are refused (3 attempts); 3 * 5 s when connects go unanswered;
3 * 15 s (HTTP; 3 * 30 s for a size or existence lookup, which fsspec asks by HEAD, then GET)
or 5 * 15 s (S3) when a server accepts and never answers. A server that answers, but trickles
(a byte every 2 s resets any read timeout), is stopped by a ranged read's deadline
(``Timeouts.deadline_s``: a floor on the rate after a grace period, for all attempts together),
then ``RemoteReadError`` naming URL and range.

Pinned reads (``VersionPin``, recorded when a shard is opened, ``stamps.open_version``): every
ranged read of it asks the store for that version (S3: by ``VersionId``, or ``If-Match`` the
ETag; HTTP: ``If-Match`` a strong ETag, else ``If-Unmodified-Since``), so an object rewritten
mid-run is ``ObjectChangedError`` naming the shard, never the new bytes. Imports nothing of ours
but ``errors`` (``fs.py``, above it, has ``file_size`` and ``open_read``). Whole files copied into
a local file (staging): ``file_copy.py``, through ``read_parts`` or ``read_with_retries``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import fsspec.asyn

from stallfree.errors import MissingShardError, RemoteReadError, ShardError, ShardReadError

log = logging.getLogger(__name__)

# Exceptions from these packages are transport failures (the request did not complete), whatever
# their class: botocore's EndpointConnectionError and ReadTimeoutError are not OSErrors, aiohttp's
# ClientResponseError (a 5xx) is not either. Matched by module so shards/ imports neither.
_TRANSPORT_MODULES = ("aiohttp", "botocore", "aiobotocore", "urllib3", "requests", "http.client", "fsspec")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a failed or short read is asked again: ``attempts`` in all (1: never again),
    waiting ``backoff_s``, then twice that, ... at most ``max_backoff_s`` between attempts."""

    attempts: int = 3
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(
                f"RetryPolicy backoff must not be negative, got {self.backoff_s} / {self.max_backoff_s}"
            )

    def delays(self) -> Iterator[float]:
        """The waits before the 2nd, 3rd, ... attempt (``attempts - 1`` of them)."""
        for n in range(self.attempts - 1):
            yield min(self.max_backoff_s, self.backoff_s * (2**n))


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long a remote read may take. ``connect_s`` / ``read_s``: given to the storage client
    when the user gave none (s3fs's own defaults, 5 s / 15 s; aiohttp's default for fsspec's
    HTTP client is a 300 s total, which let a server that accepts and never answers hold a read
    for five minutes).

    ``part_grace_s`` / ``part_min_bytes_per_s``: the deadline of one ranged read of ``n`` bytes,
    all its attempts together, is ``part_grace_s + n / part_min_bytes_per_s`` (``deadline_s``).
    Why a floor on the rate and not one fixed deadline: reads here go from a 4 KB sample to a
    16 MB staging part, and any one number either kills big parts on a slow link or lets a small
    read trickle for minutes. A read timeout cannot do it: it bounds the *gap* between bytes, and
    a server that sends a byte every 2 s (a broken proxy, a throttled or overloaded store) never
    trips it; such a download held a loader for ever (issue 36). The defaults (30 s, then
    256 KiB/s: 94 s for a 16 MiB part, 30.4 s for a 100 KB sample) are far below any link a
    training job can run on, so they end only reads that would have stalled it anyway; set them
    with ``open_dataset(url, stallfree_timeouts=Timeouts(...))``. Enforced for s3fs and fsspec's
    HTTP client (async filesystems: the request is cancelled) and the presigned S3 route
    (``s3direct``); a synchronous fsspec backend has only its own timeouts."""

    connect_s: float = 5.0
    read_s: float = 15.0
    part_grace_s: float = 30.0
    part_min_bytes_per_s: float = 256 * 1024

    def __post_init__(self) -> None:
        if self.connect_s <= 0 or self.read_s <= 0:
            raise ValueError(f"timeouts must be positive, got connect {self.connect_s}, read {self.read_s}")
        if self.part_grace_s <= 0 or self.part_min_bytes_per_s <= 0:
            raise ValueError(
                f"a read's deadline must be positive, got part_grace_s {self.part_grace_s}, "
                f"part_min_bytes_per_s {self.part_min_bytes_per_s}"
            )

    def deadline_s(self, nbytes: int) -> float:
        """Seconds a ranged read of ``nbytes`` may take, all attempts together."""
        return self.part_grace_s + max(0, nbytes) / self.part_min_bytes_per_s


@dataclass(frozen=True, slots=True)
class VersionPin:
    """The version of an object every ranged read of it must get (recorded when its shard is
    opened: ``stamps.open_version``). ``version_id``: S3's ``VersionId`` (read by it: the old
    bytes stay readable after a rewrite); ``etag``: sent as ``If-Match`` (S3; HTTP when strong);
    ``last_modified``: HTTP's ``Last-Modified``, sent as ``If-Unmodified-Since`` where the server
    sends no strong ETag (one-second resolution: a rewrite within the same second is not seen)."""

    etag: str | None = None
    version_id: str | None = None
    last_modified: str | None = None

    def __post_init__(self) -> None:
        if not (self.etag or self.version_id or self.last_modified):
            raise ValueError("a VersionPin needs an etag, a version_id or a last_modified")

    def describe(self) -> str:
        """What was pinned, as a user reads it: ``VersionId abc``, ``ETag "d41d..."``."""
        if self.version_id:
            return f"VersionId {self.version_id}"
        if self.etag:
            return f"ETag {self.etag}"
        return f"Last-Modified {self.last_modified}"


class ObjectChangedError(RemoteReadError):
    """The object changed since its shard was opened: the store refused a ranged read pinned to
    the version recorded then (HTTP 412 Precondition Failed). A ``RemoteReadError`` with the same
    fields (URL, shard, sample key, range) and ``pinned``: what was recorded (``VersionPin.describe``).
    Not retried: the bytes the dataset was indexed with are gone."""

    def __init__(self, message: str, *, pinned: str | None = None, **fields: Any) -> None:
        self.pinned = pinned
        super().__init__(message, **fields)

    def __reduce__(self):
        fields = {k: getattr(self, k) for k in ("shard", "key", "offset", "url", "start", "end", "got")}
        return (_rebuild_changed, (self.reason, self.pinned, fields))


def _rebuild_changed(reason: str, pinned: str | None, fields: dict[str, Any]) -> ObjectChangedError:
    return ObjectChangedError(reason, pinned=pinned, **fields)


# What a read without ``policy=`` uses (looked up at call time, so tests can shorten the backoff).
DEFAULT_POLICY = RetryPolicy()
DEFAULT_TIMEOUTS = Timeouts()

# id(fs) -> the Timeouts a dataset asked for (``url_to_fs(..., stallfree_timeouts=)``); an entry
# goes with its filesystem (by identity: fsspec's equality ignores what is not a client option)
_FS_TIMEOUTS: dict[int, Timeouts] = {}
_FS_TIMEOUTS_LOCK = threading.Lock()


def _renew_locks_after_fork() -> None:
    """A fork while another thread held ``_FS_TIMEOUTS_LOCK`` would leave it locked in the child
    (a loader worker's first read would wait for ever)."""
    global _FS_TIMEOUTS_LOCK
    _FS_TIMEOUTS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_renew_locks_after_fork)


def timeouts_for(fs: fsspec.AbstractFileSystem) -> Timeouts:
    """The ``Timeouts`` reads of ``fs`` keep: those it was made with, else ``DEFAULT_TIMEOUTS``."""
    return _FS_TIMEOUTS.get(id(fs)) or DEFAULT_TIMEOUTS


# -- reads ----------------------------------------------------------------------------------


def read_range(
    fs: fsspec.AbstractFileSystem,
    path: str,
    start: int,
    end: int,
    *,
    shard: str,
    key: str | None = None,
    policy: RetryPolicy | None = None,
    pin: VersionPin | None = None,
) -> bytes:
    """Bytes ``[start, end)`` of ``path``: exactly ``end - start`` of them, or an error (see the
    module docstring); with ``pin``, of that version of the object or ``ObjectChangedError``.
    ``shard`` and ``key`` only name the read in errors."""
    if start < 0 or end < start:
        raise ValueError(f"bad range [{start}, {end}) for {path}")
    if start == end:
        return b""
    deadline = _Deadline.enforced(fs, end - start)
    try:  # the common case first, without the retry loop's set-up (~1.5 µs a read)
        if pin is None and deadline is None:
            # keywords: s3fs's cat_file takes ``version_id`` second
            first: Any = fs.cat_file(path, start=start, end=end)
        else:
            first = _get(fs, path, start, end, pin, deadline.left() if deadline else 0.0)
    except Exception as exc:  # noqa: BLE001 - classified in the loop
        first = exc
    if type(first) is bytes and len(first) == end - start:
        return first
    return _retrying(
        fs, path, start, end, shard, key, policy or DEFAULT_POLICY, first, pin=pin, deadline=deadline
    )


def read_ranges(
    fs: fsspec.AbstractFileSystem,
    path: str,
    ranges: Sequence[tuple[int, int]],
    *,
    shard: str,
    keys: Sequence[str | None] | None = None,
    policy: RetryPolicy | None = None,
    pin: VersionPin | None = None,
) -> list[bytes]:
    """Several ranges of one file, concurrently where the filesystem can (``cat_ranges``); each
    checked like ``read_range``, and only the failed or short ones asked again. ``keys[i]`` names
    range ``i``'s first sample in errors. The ranges share one deadline, that of their bytes
    together (they share the link)."""
    if keys is not None and len(keys) != len(ranges):
        raise ValueError(f"{len(keys)} keys for {len(ranges)} ranges")
    names = list(keys) if keys is not None else [None] * len(ranges)
    if len(ranges) == 1:
        return [read_range(fs, path, *ranges[0], shard=shard, key=names[0], policy=policy, pin=pin)]
    deadline = _Deadline.enforced(fs, sum(max(0, b - a) for a, b in ranges))
    try:
        first: list[Any] = _get_many(fs, path, ranges, pin, deadline.left() if deadline else 0.0)
    except Exception as exc:  # one failure for all: each range then goes its own way
        first = [exc] * len(ranges)
    out = []
    for (start, end), got, key in zip(ranges, first, names, strict=True):
        if isinstance(got, bytes) and len(got) == end - start:
            out.append(got)
        else:
            out.append(
                _retrying(
                    fs,
                    path,
                    start,
                    end,
                    shard,
                    key,
                    policy or DEFAULT_POLICY,
                    got,
                    pin=pin,
                    deadline=deadline,
                )
            )
    return out


# -- one attempt: plain, within a deadline, pinned to a version -----------------------------


class _Deadline:
    """When a read must be done by (monotonic), and the ``Timeouts`` that set it."""

    __slots__ = ("at", "nbytes", "timeouts")

    def __init__(self, at: float, nbytes: int, timeouts: Timeouts) -> None:
        self.at, self.nbytes, self.timeouts = at, nbytes, timeouts

    @staticmethod
    def start(fs: Any, nbytes: int) -> _Deadline:
        timeouts = timeouts_for(fs)
        return _Deadline(time.monotonic() + timeouts.deadline_s(nbytes), nbytes, timeouts)

    @staticmethod
    def enforced(fs: Any, nbytes: int) -> _Deadline | None:
        """``start``, for a filesystem whose requests can be held to it (an async one: fsspec's
        ``timeout=`` cancels them); None for a synchronous backend (its own timeouts only, and
        its reads pay nothing for a deadline they could not keep)."""
        return _Deadline.start(fs, nbytes) if getattr(fs, "async_impl", False) else None

    def left(self) -> float:
        """Seconds left (at least a millisecond: 0 means "no timeout" to fsspec)."""
        return max(0.001, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def explain(self) -> str:
        t = self.timeouts
        return (
            f"did not finish within its deadline of {t.deadline_s(self.nbytes):.1f} s "
            f"(Timeouts.part_grace_s {t.part_grace_s:g} s, then {t.part_min_bytes_per_s:g} bytes/s "
            f"for {self.nbytes} bytes): the server is sending too slowly"
        )


def _limit(fs: Any, seconds: float) -> dict[str, Any]:
    """The keyword that bounds a call of an async filesystem's sync method (fsspec's ``sync``
    takes ``timeout=`` and cancels the request when it passes); none for a synchronous one."""
    return {"timeout": seconds} if getattr(fs, "async_impl", False) else {}


def pin_route(fs: Any) -> str | None:
    """How ranged reads of ``fs`` can be pinned to a version: ``"s3"`` (s3fs: ``VersionId`` or
    ``If-Match``), ``"http"`` (fsspec's HTTP client: conditional headers), or None."""
    module = type(fs).__module__ or ""
    if module.startswith("s3fs"):
        return "s3"
    if module.startswith("fsspec.implementations.http"):
        return "http"
    return None


def _http_conditions(fs: Any, pin: VersionPin) -> dict[str, Any]:
    """``headers=`` for fsspec's HTTP ``cat_file``: the filesystem's own headers (the keyword
    replaces them) and the condition."""
    headers = dict((getattr(fs, "kwargs", None) or {}).get("headers") or {})
    if pin.etag:
        headers["If-Match"] = pin.etag
    else:
        headers["If-Unmodified-Since"] = str(pin.last_modified)
    return {"headers": headers}


async def _s3_pinned(fs: Any, path: str, ranges: Sequence[tuple[int, int]], pin: VersionPin) -> list[Any]:
    """Ranged GETs through s3fs's client with the version asked for (s3fs's ``cat_file`` cannot
    send ``If-Match``); each outcome bytes or the exception, as ``cat_ranges(on_error="return")``."""
    bucket, key, _ = fs.split_path(path)
    condition = {"VersionId": pin.version_id} if pin.version_id else {"IfMatch": pin.etag}

    async def one(start: int, end: int) -> bytes:
        resp = await fs._call_s3(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **condition
        )
        try:
            return await resp["Body"].read()
        except Exception as exc:
            # s3fs retries a body read inside its cat_file, not here: a transport failure for our
            # retries (its own class, e.g. ClientPayloadError, would read as retried by s3fs)
            raise ConnectionError(f"the body of bytes {start}..{end} broke off: {exc!r}") from exc
        finally:
            resp["Body"].close()

    return list(await asyncio.gather(*(one(a, b) for a, b in ranges), return_exceptions=True))


def _get(fs: Any, path: str, start: int, end: int, pin: VersionPin | None, seconds: float) -> Any:
    """One attempt at bytes ``[start, end)`` (the bytes; raises on failure)."""
    if pin is None:
        # keywords: s3fs's cat_file takes ``version_id`` second
        return fs.cat_file(path, start=start, end=end, **_limit(fs, seconds))
    route = pin_route(fs)
    if route == "s3":
        got = fsspec.asyn.sync(fs.loop, _s3_pinned, fs, path, [(start, end)], pin, timeout=seconds)[0]
        if isinstance(got, BaseException):
            raise got
        return got
    if route == "http":
        return fs.cat_file(path, start=start, end=end, **_http_conditions(fs, pin), **_limit(fs, seconds))
    raise ValueError(f"{type(fs).__name__} reads cannot be pinned to a version ({pin.describe()})")


def _get_many(
    fs: Any, path: str, ranges: Sequence[tuple[int, int]], pin: VersionPin | None, seconds: float
) -> list[Any]:
    """One attempt at each range, concurrently: bytes or the exception, per range."""
    if pin is not None and pin_route(fs) == "s3":
        return fsspec.asyn.sync(fs.loop, _s3_pinned, fs, path, list(ranges), pin, timeout=seconds)
    extra = _http_conditions(fs, pin) if pin is not None and pin_route(fs) == "http" else {}
    if pin is not None and not extra:
        raise ValueError(f"{type(fs).__name__} reads cannot be pinned to a version ({pin.describe()})")
    return fs.cat_ranges(
        [path] * len(ranges),
        starts=[r[0] for r in ranges],
        ends=[r[1] for r in ranges],
        on_error="return",
        **extra,
        **_limit(fs, seconds),
    )


def read_file(
    fs: fsspec.AbstractFileSystem,
    path: str,
    *,
    shard: str,
    size: int | None = None,
    policy: RetryPolicy | None = None,
) -> bytes:
    """A whole (small) file: ``.idx``, manifest, a token index. With ``size`` it is a checked
    ``read_range(0, size)``; without, failures are retried but the length cannot be checked (the
    caller's parser is then the check), which saves the ``HEAD`` a size would cost."""
    if size is not None:
        return read_range(fs, path, 0, size, shard=shard, policy=policy)
    return _retrying(fs, path, None, None, shard, None, policy or DEFAULT_POLICY, None)


PART_BYTES = 16 << 20  # one ranged GET of a whole-shard read: a 16 MB shard is one request
PART_CONCURRENCY = 8


def read_parts(
    fs: fsspec.AbstractFileSystem,
    path: str,
    size: int,
    *,
    shard: str,
    part_bytes: int = PART_BYTES,
    concurrency: int = PART_CONCURRENCY,
    policy: RetryPolicy | None = None,
) -> Iterator[tuple[int, bytes]]:
    """A whole file of ``size`` bytes in few large ranged reads: ``(offset, bytes)`` of each
    ``part_bytes`` part, in file order, ``concurrency`` parts asked at once (``read_ranges``:
    each checked and retried like every read here). Memory: at most ``concurrency`` parts.

    Why: a shard window read sample by sample cost one GET per sample on an object store (the
    requests a bucket bills, a round trip each); whole shards in 16 MB parts cost one per part."""
    if part_bytes < 1 or concurrency < 1:
        raise ValueError(f"part_bytes and concurrency must be >= 1, got {part_bytes}, {concurrency}")
    starts = list(range(0, size, part_bytes))
    for first in range(0, len(starts), concurrency):
        group = [(s, min(size, s + part_bytes)) for s in starts[first : first + concurrency]]
        for (start, _), data in zip(
            group, read_ranges(fs, path, group, shard=shard, policy=policy), strict=True
        ):
            yield start, data


def exists(
    fs: fsspec.AbstractFileSystem, path: str, *, shard: str, policy: RetryPolicy | None = None
) -> bool:
    """Whether ``path`` exists, telling "not there" from "could not ask": fsspec's HTTP
    ``exists`` answers False for a 500 or a refused connection (and ``open_dataset`` then said
    "no dataset at URL"); here those are retried and then a ``RemoteReadError`` naming the
    status or the endpoint."""
    return lookup(fs, path, shard=shard, policy=policy) is not None


def _whole_file_options(fs: fsspec.AbstractFileSystem) -> dict[str, Any]:
    """Options for reading a whole (small) file in one request. s3fs asks the object's size
    with a HEAD before every whole-file read, to split big ones into concurrent parts; the files
    read whole here are small (manifest, ``.idx``), so that HEAD was a round trip for nothing
    (25-70 ms per shard opened, at 10 ms each way)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return {"max_concurrency": 1} if any(p in ("s3", "s3a") for p in protocols) else {}


def read_with_retries(
    fs: fsspec.AbstractFileSystem,
    path: str,
    start: int,
    end: int,
    *,
    shard: str,
    fetch: Callable[[float], Any],
    key: str | None = None,
    policy: RetryPolicy | None = None,
) -> Any:
    """Bytes ``[start, end)`` of ``path`` as another transport reads them (``fetch(deadline_at)``:
    one attempt, done by ``deadline_at`` (``time.monotonic``) or raising, returning the bytes, or
    the count it wrote somewhere), with this module's checks, retries, deadline and errors (see
    the module docstring): how ``file_copy``'s direct S3 route stays one primitive."""
    deadline = _Deadline.start(fs, end - start)
    return _retrying(
        fs, path, start, end, shard, key, policy or DEFAULT_POLICY, None, fetch=fetch, deadline=deadline
    )


def _retrying(
    fs: fsspec.AbstractFileSystem,
    path: str,
    start: int | None,
    end: int | None,
    shard: str,
    key: str | None,
    policy: RetryPolicy,
    first: Any,
    fetch: Callable[[float], Any] | None = None,
    pin: VersionPin | None = None,
    deadline: _Deadline | None = None,
) -> Any:
    """The attempt loop; ``first`` is the outcome of an attempt already made (bytes or an
    exception), or None. ``fetch`` makes an attempt other than ``cat_file``: its outcome is
    bytes, or (a copy into a file) the number of bytes the server sent, checked alike.
    ``deadline`` bounds all attempts together (a ranged read; None for a whole file of unknown
    size); ``pin`` the version every attempt asks for."""
    want = None if start is None or end is None else end - start
    delays = policy.delays()
    outcome = first
    short: int | None = None
    last: BaseException | None = None
    for attempt in range(policy.attempts):
        if outcome is None:
            if deadline is not None and deadline.passed():
                raise _late(fs, path, start, end, shard, key, attempt, deadline, short) from None
            try:
                if fetch is not None:
                    outcome = fetch(deadline.at if deadline is not None else float("inf"))
                elif want is not None:
                    outcome = _get(fs, path, start, end, pin, deadline.left() if deadline else 0)
                else:
                    outcome = fs.cat_file(path, **_whole_file_options(fs))
            except Exception as exc:
                outcome = exc
        counted = isinstance(outcome, int) and not isinstance(outcome, bool)
        if counted or isinstance(outcome, bytes | bytearray | memoryview):
            got = outcome if counted else len(outcome)
            if want is None or got == want:
                return outcome if counted or isinstance(outcome, bytes) else bytes(outcome)
            if got > want:  # the server ignored Range: which bytes are ours is not known
                raise RemoteReadError(
                    f"{describe(fs, path)} returned {got} bytes for bytes {start}..{end} ({want} bytes): "
                    "the server does not honour HTTP Range requests (serve it from one that does)",
                    shard=shard,
                    key=key,
                    offset=start,
                    url=describe(fs, path),
                    start=start,
                    end=end,
                    got=got,
                )
            short, last = got, None
            log.debug(
                "short read of %s [%s, %s): %d of %d bytes (try %d)", path, start, end, got, want, attempt + 1
            )
        else:
            exc = outcome
            short = None
            if _raise_final(fs, path, start, end, shard, key, exc, pin):
                raise _failed(fs, path, start, end, shard, key, attempt + 1, exc, None) from None
            if deadline is not None and deadline.passed():
                raise _late(fs, path, start, end, shard, key, attempt + 1, deadline, None) from None
            if client_retries(fs, exc):  # the client retried it already: again multiplies the wait
                raise _failed(fs, path, start, end, shard, key, attempt + 1, exc, None) from None
            last = exc
            log.debug("read of %s [%s, %s) failed (attempt %d): %r", path, start, end, attempt + 1, exc)
        outcome = None
        delay = next(delays, None)
        if delay is not None:
            time.sleep(delay if deadline is None else min(delay, max(0.0, deadline.at - time.monotonic())))
    raise _failed(fs, path, start, end, shard, key, policy.attempts, last, short) from None


def _late(
    fs: fsspec.AbstractFileSystem,
    path: str,
    start: int | None,
    end: int | None,
    shard: str,
    key: str | None,
    attempts: int,
    deadline: _Deadline,
    short: int | None,
) -> RemoteReadError:
    """The error for a ranged read that ran past its deadline (``Timeouts.deadline_s``)."""
    url = describe(fs, path)
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    return RemoteReadError(
        f"reading bytes {start}..{end} of {url} {deadline.explain()} ({tries})",
        shard=shard,
        key=key,
        offset=start,
        url=url,
        start=start,
        end=end,
        got=short,
    )


def _raise_final(
    fs: fsspec.AbstractFileSystem,
    path: str,
    start: int | None,
    end: int | None,
    shard: str,
    key: str | None,
    exc: BaseException,
    pin: VersionPin | None = None,
) -> bool:
    """Raise the error for a failure that asking again cannot mend; return whether the server
    refused the request outright (the caller words that), False for a transient failure."""
    kind = classify(exc)
    if kind == "changed" and pin is not None:
        url = describe(fs, path)
        raise ObjectChangedError(
            f"{url} changed since its shard was opened: the store no longer has the version read then "
            f"({pin.describe()}; HTTP 412 for bytes {start}..{end}). The dataset was rewritten "
            "while in use: reopen it (a manifest's digests make staged reads check every copy)",
            pinned=pin.describe(),
            shard=shard,
            key=key,
            offset=start,
            url=url,
            start=start,
            end=end,
        ) from None
    if kind == "missing":
        raise MissingShardError(f"{describe(fs, path)} not found", shard=shard, key=key) from None
    if kind == "denied":  # the store answered, and said no: not damaged
        raise ShardReadError(
            f"access denied reading {describe(fs, path)}: {exc or type(exc).__name__} "
            "(check the credentials and the bucket's policy)",
            shard=shard,
            key=key,
            offset=start,
        ) from None
    if kind in ("shard", "foreign"):
        raise exc  # ours already, or a bug or a bad argument: not ours to reword
    return kind in ("refused", "changed")


def _failed(
    fs: fsspec.AbstractFileSystem,
    path: str,
    start: int | None,
    end: int | None,
    shard: str,
    key: str | None,
    attempts: int,
    last: BaseException | None,
    short: int | None,
    what: str = "reading",
) -> RemoteReadError:
    url = describe(fs, path)
    tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
    own = client_retries(fs, last) if short is None else 0
    if own:
        tries = f"{own} attempts by {type(fs).__name__}"
    if short is not None and start is not None and end is not None:
        asked = f"bytes {start}..{end} ({end - start} bytes)"
        message = f"short read from {url}: asked for {asked}, got {short} ({tries})"
    elif start is not None and end is not None:
        message = f"reading bytes {start}..{end} of {url} failed ({tries}): {explain(last)}"
    else:
        message = f"{what} {url} failed ({tries}): {explain(last)}"
    return RemoteReadError(
        message,
        shard=shard,
        key=key,
        offset=start,
        url=url,
        start=start,
        end=end,
        got=short,
    )


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over ``read_range``: what pyarrow reads a remote Arrow or
    Parquet file through (``pa.PythonFile(RangeFile(...))``), so those reads are checked and
    retried like every other. fsspec's own file objects hand a short body back as it came.
    ``block_size`` > 0 reads ahead that many bytes (a sequential walk of an Arrow stream);
    0 reads exactly what is asked (random access to record batches). ``pin``: every read asks
    for that version of the object (``read_range``)."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        size: int,
        *,
        shard: str,
        block_size: int = 0,
        policy: RetryPolicy | None = None,
        pin: VersionPin | None = None,
    ) -> None:
        super().__init__()
        self._fs, self._path, self.size, self._shard = fs, path, size, shard
        self._block, self._policy, self._pin = block_size, policy, pin
        self._pos = 0
        self._buf, self._buf_start = b"", 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset} in {self._path}")
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if self.closed:
            raise ValueError(f"I/O on a closed file: {self._path}")
        start = min(self._pos, self.size)
        end = self.size if n is None or n < 0 else min(self.size, start + n)
        b0 = self._buf_start
        if b0 <= start and end <= b0 + len(self._buf):
            data = self._buf[start - b0 : end - b0]
        elif self._block and end - start < self._block:
            fetch_end = min(self.size, start + self._block)
            self._buf = read_range(
                self._fs, self._path, start, fetch_end, shard=self._shard, policy=self._policy, pin=self._pin
            )
            self._buf_start = start
            data = self._buf[: end - start]
        else:
            data = read_range(
                self._fs, self._path, start, end, shard=self._shard, policy=self._policy, pin=self._pin
            )
        self._pos = start + len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)


def client_retries(fs: fsspec.AbstractFileSystem, exc: BaseException | None) -> int:
    """How many times the filesystem's client itself already tried the request that failed with
    ``exc``: s3fs tries ``fs.retries`` (5) times, with backoff, for the errors its module lists
    in ``S3_RETRYABLE_ERRORS`` (timeouts, dropped connections; not a refused connection). 0 if
    it does not. Such a failure is final here: three layers of retries (ours, s3fs's,
    botocore's) made a dead S3 endpoint cost ~6.4 s a sample, and a silent one minutes. Short
    reads are still retried: no client checks lengths."""
    own = getattr(fs, "retries", None)
    if exc is None or not isinstance(own, int) or isinstance(own, bool) or own < 2:
        return 0
    module = sys.modules.get(type(fs).__module__)
    retryable = next(
        (v for k, v in vars(module).items() if k.endswith("_RETRYABLE_ERRORS")) if module else (), None
    )
    if not isinstance(retryable, tuple) or not isinstance(exc, retryable):
        return 0
    return own


def lookup(
    fs: fsspec.AbstractFileSystem, path: str, *, shard: str, policy: RetryPolicy | None = None
) -> dict[str, Any] | None:
    """``fs.info(path)``, None for "not there"; transport failures retried, then RemoteReadError
    (``fs.file_size`` is the size from it, ``stamps`` the object's version)."""
    policy = policy or DEFAULT_POLICY
    last: BaseException | None = None
    for attempt, delay in enumerate([*policy.delays(), None]):
        try:
            return fs.info(path)
        except Exception as exc:
            kind = classify(exc)
            if kind == "missing":
                return None
            if kind in ("denied", "shard", "foreign"):
                raise
            last = _transport_cause(exc) or exc
            if kind in ("refused", "changed") or client_retries(fs, last):
                raise _failed(
                    fs, path, None, None, shard, None, attempt + 1, last, None, "looking up"
                ) from None
        if delay is not None:
            time.sleep(delay)
    raise _failed(fs, path, None, None, shard, None, policy.attempts, last, None, "looking up") from None


# -- errors ---------------------------------------------------------------------------------


def is_transport_error(exc: BaseException) -> bool:
    """The request did not complete (connection, timeout, server error): asking again may work."""
    if isinstance(exc, OSError | TimeoutError):
        return True
    for cls in type(exc).__mro__:
        module = cls.__module__
        if module in _TRANSPORT_MODULES or module.split(".", 1)[0] in _TRANSPORT_MODULES:
            return True
    return False


def status_of(exc: BaseException) -> int | None:
    """The HTTP status a client error carries: aiohttp's ``status``, botocore's
    ``response["ResponseMetadata"]["HTTPStatusCode"]``; None if it has none."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


def _precondition_failed(exc: BaseException) -> bool:
    """HTTP 412 (a conditional read whose version is gone), on the error or its causes (s3fs
    turns botocore's ``PreconditionFailed`` into an ``OSError`` caused by it)."""
    seen = 0
    while exc is not None and seen < 5:
        if status_of(exc) == 412:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def classify(exc: BaseException) -> str:
    """What a failed request means: ``missing`` (404), ``denied`` (401/403), ``changed`` (412: a
    pinned version is gone), ``retry`` (no answer, a timeout, 5xx, 408, 416, 429: asking again
    may work), ``refused`` (another 4xx: it will not), ``shard`` (already one of our errors) or
    ``foreign`` (not a storage failure at all: a bug)."""
    if isinstance(exc, ShardError):
        return "shard"
    if _precondition_failed(exc):
        return "changed"
    if isinstance(exc, FileNotFoundError):
        return "retry" if _transport_cause(exc) is not None else "missing"
    if isinstance(exc, PermissionError):
        return "denied"
    status = status_of(exc)
    if status is not None:
        if status in (404, 410):
            return "missing"
        if status in (401, 403):
            return "denied"
        return "retry" if status >= 500 or status in (408, 416, 429) else "refused"
    return "retry" if is_transport_error(exc) else "foreign"


def _transport_cause(exc: BaseException) -> BaseException | None:
    """fsspec's HTTP ``info`` turns every failure into FileNotFoundError; the real one (a 500, a
    refused connection) is its cause. None when it really is "not found"."""
    cause = exc.__cause__ or exc.__context__
    seen = 0
    while cause is not None and seen < 5:
        status = status_of(cause)
        if status is not None:
            return cause if status >= 500 or status in (408, 429) else None
        if not isinstance(cause, FileNotFoundError) and is_transport_error(cause):
            return cause
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return None


def explain(exc: BaseException | None) -> str:
    """A short, plain account of a transport failure (status, or the library's words)."""
    if exc is None:
        return "no answer"
    status = status_of(exc)
    if isinstance(status, int):
        words = getattr(exc, "message", None) or str(exc)
        return (
            f"the server answered HTTP {status}: {words}" if words else f"the server answered HTTP {status}"
        )
    text = str(exc)
    if isinstance(exc, TimeoutError):
        return f"no answer within the timeout ({type(exc).__name__}{': ' + text if text else ''})"
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def endpoint_of(fs: fsspec.AbstractFileSystem) -> str | None:
    """The endpoint a filesystem talks to, where it has one besides the URL (S3-compatible stores)."""
    kwargs = getattr(fs, "client_kwargs", None)
    if isinstance(kwargs, dict) and kwargs.get("endpoint_url"):
        return str(kwargs["endpoint_url"])
    url = getattr(fs, "endpoint_url", None)
    return str(url) if url else None


def describe(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``s3://bucket/key (endpoint http://host:port)`` or ``http://host/path``: what a user typed."""
    try:
        url = fs.unstrip_protocol(path)
    except Exception:  # noqa: BLE001 - only naming it
        url = path
    endpoint = endpoint_of(fs)
    return f"{url} (endpoint {endpoint})" if endpoint else url


def unreachable(url: str, fs: fsspec.AbstractFileSystem | None, exc: BaseException) -> RemoteReadError:
    """The error for a store that could not be asked at all (open time): names the endpoint the
    user gave, not the client library's exception class."""
    endpoint = endpoint_of(fs) if fs is not None else None
    where = f"endpoint {endpoint}" if endpoint else url
    return RemoteReadError(f"cannot reach {where} (opening {url}): {explain(exc)}", shard=url, url=url)


# -- timeouts -------------------------------------------------------------------------------


def protocol_of(url: str) -> str:
    """The outermost protocol of ``url`` (``file`` for a plain path)."""
    proto = fsspec.core.split_protocol(url.split("::", 1)[0])[0]
    return proto or "file"


def with_timeouts(
    url: str, storage_options: dict[str, Any], timeouts: Timeouts = DEFAULT_TIMEOUTS
) -> dict[str, Any]:
    """``storage_options`` plus connect/read timeouts for ``url``'s store where the user set none
    (a copy; what the user passed is never overwritten). S3 (s3fs): botocore's ``connect_timeout``
    and ``read_timeout`` in ``config_kwargs``, and botocore's own retries off (s3fs retries, and
    so does this module what s3fs does not: three layers made a dead endpoint cost ~6.4 s per
    sample). HTTP: an aiohttp ``ClientTimeout`` with ``sock_connect``/``sock_read``.
    Other stores, and chained URLs, are left as they are."""
    options = dict(storage_options)
    if "::" in url:
        return options
    proto = protocol_of(url)
    if proto in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeouts.connect_s)
        config.setdefault("read_timeout", timeouts.read_s)
        config.setdefault("retries", {"total_max_attempts": 1})
        # botocore's 10 connections per client would cap a staged window's ranged GETs (16 for 8
        # shards of two parts) and a batch's concurrent shard reads
        config.setdefault("max_pool_connections", 32)
        # what botocore signs S3 requests with anyway; said here so that presigned GETs (the
        # direct route of file_copy.copy_parts) are SigV4 too: botocore presigns with SigV2
        # otherwise, which buckets made since 2020 refuse (anon=True stays unsigned: s3fs says so)
        config.setdefault("signature_version", "s3v4")
        options["config_kwargs"] = config
    elif proto in ("http", "https"):
        client = dict(options.get("client_kwargs") or {})
        if "timeout" not in client:
            import aiohttp

            client["timeout"] = aiohttp.ClientTimeout(
                total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.read_s
            )
        options["client_kwargs"] = client
    return options


TIMEOUTS_OPTION = "stallfree_timeouts"  # the storage option that carries a dataset's Timeouts


def url_to_fs(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """``fsspec.core.url_to_fs`` with ``with_timeouts`` applied (and, for S3, ``with_session``):
    how shards/ (and tokens/) make a filesystem from a user's URL and options.

    ``stallfree_timeouts=Timeouts(...)`` (ours, not passed to fsspec): this filesystem's connect
    and read timeouts where the options set none, and its reads' deadline (``timeouts_for``); it
    then gets a filesystem of its own (not fsspec's cached instance, which others may share)."""
    timeouts = storage_options.pop(TIMEOUTS_OPTION, None)
    if timeouts is None:
        return fsspec.core.url_to_fs(url, **with_session(url, with_timeouts(url, storage_options)))
    if not isinstance(timeouts, Timeouts):
        raise TypeError(f"{TIMEOUTS_OPTION} must be a stallfree Timeouts, got {type(timeouts).__name__}")
    options = {
        **with_session(url, with_timeouts(url, storage_options, timeouts)),
        "skip_instance_cache": True,
    }
    fs, path = fsspec.core.url_to_fs(url, **options)
    key = id(fs)
    with _FS_TIMEOUTS_LOCK:
        _FS_TIMEOUTS[key] = timeouts
    try:
        weakref.finalize(fs, _FS_TIMEOUTS.pop, key, None)
    except TypeError:  # not weakly referable: kept for the process (a few bytes)
        pass
    return fs, path


_MODEL_LOADER: Any = None  # botocore's loader of service models, shared by this process's sessions
_SESSION: tuple[int, Any] | None = None  # (pid, this process's aiobotocore session)


def with_session(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """For an S3 URL whose options name no session or profile: this process's aiobotocore
    session, made with the botocore model loader of the process it was forked from (a copy of
    the options; anything else is returned as it is).

    Why: every new S3 client parses botocore's JSON model of S3 first, ~100 ms of CPU (measured
    in a loader worker: first request 0.18 s with a session of its own, 0.08 s with the parent's
    loader). A loader's workers make new clients after fork (the parent's are not fork-safe), and
    so did every epoch's fresh pool; the loader is a cache of parsed files, not a connection,
    so the parent's serves its forked children. The session itself is per process (its
    credentials may hold locks of the process's event loop), and one per process keeps fsspec's
    instance cache working (the session is part of its key)."""
    if "::" in url or protocol_of(url) not in ("s3", "s3a"):
        return storage_options
    if any(k in storage_options for k in ("session", "profile", "kwargs")):
        return storage_options
    global _MODEL_LOADER, _SESSION
    pid = os.getpid()
    if _SESSION is None or _SESSION[0] != pid:
        try:
            from aiobotocore.session import AioSession
        except ModuleNotFoundError:  # no s3fs installed: fsspec then says which package to install
            return storage_options

        session = AioSession()
        if _MODEL_LOADER is None:
            _MODEL_LOADER = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _MODEL_LOADER)
        _SESSION = (pid, session)
    return {**storage_options, "session": _SESSION[1]}


__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_TIMEOUTS",
    "TIMEOUTS_OPTION",
    "ObjectChangedError",
    "RetryPolicy",
    "Timeouts",
    "VersionPin",
    "RangeFile",
    "pin_route",
    "timeouts_for",
    "describe",
    "exists",
    "lookup",
    "is_transport_error",
    "read_file",
    "read_parts",
    "read_range",
    "read_ranges",
    "read_with_retries",
    "unreachable",
    "url_to_fs",
    "with_session",
    "with_timeouts",
]
