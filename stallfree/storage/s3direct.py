"""Large ranged reads of S3 objects straight into a local file: presigned GETs over ``http.client``.

Why: staging moves whole shards (``staged_reads.py``), hundreds of MB per epoch, and through
s3fs each byte went through aiohttp's Python-level stream reader on the event loop (a chunk list,
a join, a ``bytes`` per part) before it was written: in a profile of a cold staged epoch
(``bench_s3_netns.py``, 2 cores) that loop thread was the busiest thread of the training
process. Here the request is signed once per object (``fs.url``: a presigned GET, by the same
credentials, endpoint and addressing the filesystem uses) and the body is received with
``readinto`` into one reused buffer per thread and ``pwrite`` to the file at its offset: no
Python object per chunk, the GIL released while the socket is read.

Only what a presigned URL can express takes this route (``route_for``); a filesystem with SSE-C
or other per-request headers, requester-pays, proxies, a signature other than SigV4, or an
fsspec implementation other than s3fs reads through its own client, and so does one whose
presigned GETs the store refuses (``RouteRefused``: another region, a bucket policy). One attempt
is ``DirectRoute.copy_range``; checking the length, retrying and wording errors is ``remote``'s
(through ``file_copy.copy_part``), as for every remote read. Connections are kept per thread
and per process (never used across a fork). Imports nothing of ours.

A part has a deadline (``copy_range(..., deadline_at)``, set by ``remote.Timeouts``): a read
timeout bounds each ``recv``, and a server that trickles a byte every few seconds never trips
it, in the headers or the body. So a request still running at its deadline has its socket shut
down by this process's one watchdog thread (``_Watchdog``): the blocked read returns, the part is
short or failed, and ``remote`` words it as a deadline passed.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import os
import socket
import ssl
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

CHUNK = 1 << 20  # one readinto (and one pwrite): large enough that the per-call cost vanishes
URL_LIFETIME_S = 3600  # a presigned URL's validity; renewed once half of it has passed
URLS_KEPT = 256  # presigned URLs remembered per route
_ERROR_BODY_MAX = 64 << 10  # an error response's body kept for its message, at most


class S3StatusError(Exception):
    """The store answered a GET with an HTTP error other than a refusal (``REFUSED``: those are
    ``RouteRefused``); ``status`` as ``remote.classify`` reads it (404 missing, 401 denied, 5xx
    retried), ``code`` the S3 error code where given."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.status, self.code = status, code


class RouteRefused(Exception):
    """The store refused a presigned GET in a way its own client may not be refused (a redirect
    to another region, 400, 403: a bucket policy may deny query-string authentication); the
    caller reads through the filesystem's client instead. ``__cause__``: the ``S3StatusError``."""


REFUSED = (301, 307, 400, 403)  # statuses that send a read back to the filesystem's own client


class DeadlineExceeded(TimeoutError):
    """A part's deadline passed before its request could be sent again."""


class _Watchdog:
    """Shuts down the socket of a request still running at its deadline (one daemon thread per
    process, started at the first request that has a deadline). Why a socket shutdown: the
    thread reading it is blocked in ``recv`` (http.client reads headers a line at a time and a
    body to the end of its buffer), and only the socket's end makes it return. A request is
    ``watch``-ed with its socket and deadline, and ``release``-d when it is done; the shutdown
    happens under the lock ``release`` takes, so a released socket (kept alive for the next
    request) is never shut down."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._live: set[int] = set()
        self._tokens = itertools.count()
        self._pid: int | None = None

    def watch(self, sock: socket.socket | None, deadline_at: float) -> int | None:
        if sock is None or deadline_at == float("inf"):
            return None
        with self._cond:
            if self._pid != os.getpid():  # the thread does not survive a fork; nor do the parent's sockets
                self._heap, self._live, self._pid = [], set(), os.getpid()
                threading.Thread(target=self._run, name="stallfree-deadlines", daemon=True).start()
            token = next(self._tokens)
            heapq.heappush(self._heap, (deadline_at, token, sock))
            self._live.add(token)
            self._cond.notify()
        return token

    def release(self, token: int | None) -> None:
        if token is not None:
            with self._cond:
                self._live.discard(token)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)  # released: nothing to do
                if not self._heap:
                    self._cond.wait()
                    continue
                at, token, sock = self._heap[0]
                left = at - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(token)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def after_fork_in_child(self) -> None:
        """A fork while another thread held ``_cond`` (the watchdog thread holds it between its
        waits, and a thread that took a lock may wait for the GIL before letting go) left it locked
        for ever in the child: a loader worker forked while the main process staged a window hung
        in its first ``watch``. The child gets a fresh lock and no deadlines (its thread starts
        with its first watched request)."""
        self._cond = threading.Condition()
        self._heap, self._live, self._pid = [], set(), None


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.after_fork_in_child)


class LocalWriteError(Exception):
    """Writing the received bytes to the local file failed (``__cause__``: the ``OSError``, e.g.
    a full disk): not a transport failure, so no attempt of the retry loop is spent on it."""


@dataclass(frozen=True)
class _Endpoint:
    scheme: str
    host: str
    port: int


class DirectRoute:
    """Presigned ranged GETs for one s3fs filesystem (see the module docstring)."""

    def __init__(self, fs: Any, connect_s: float, read_s: float, verify: bool | str = True) -> None:
        self._fs = weakref.ref(fs)  # the route is kept per filesystem, and must not keep it alive
        self.connect_s, self.read_s = connect_s, read_s
        self._verify = verify  # botocore's ``verify``: True, False, or a CA bundle's path
        self._ssl: ssl.SSLContext | None = None  # made at the first https connection
        # path -> (signed at, URL), the most recent few: a shard's parts and retries share one
        # (a dataset's every shard would be ~0.5 KB each, for ever)
        self._urls: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._urls_lock = threading.Lock()
        self._local = threading.local()

    @property
    def fs(self) -> Any:
        fs = self._fs()
        if fs is None:
            raise RuntimeError("the filesystem of this route is gone")
        return fs

    def serves(self, fs: Any) -> bool:
        """Whether this is ``fs``'s route (and ``fs`` the very object it was made for)."""
        return self._fs() is fs

    def url(self, path: str) -> str:
        """A presigned GET URL for ``path``, signed again once half its lifetime has passed."""
        now = time.monotonic()
        with self._urls_lock:
            got = self._urls.get(path)
        if got is not None and now - got[0] < URL_LIFETIME_S / 2:
            return got[1]
        url = self.fs.url(path, expires=URL_LIFETIME_S)
        with self._urls_lock:
            self._urls[path] = (now, url)
            self._urls.move_to_end(path)
            while len(self._urls) > URLS_KEPT:
                self._urls.popitem(last=False)
        return url

    def copy_range(self, path: str, start: int, end: int, fd: int, deadline_at: float = float("inf")) -> int:
        """One GET of bytes ``[start, end)`` of ``path``, written to ``fd`` at the same offsets
        as they arrive, done by ``deadline_at`` (``time.monotonic``). Returns the bytes the
        server sent for it: ``end - start``, fewer (the body ended early) or more (it ignored
        ``Range``; nothing is written then). Raises ``RouteRefused`` for a status in
        ``REFUSED``, ``S3StatusError`` for another HTTP error, ``LocalWriteError`` when the file
        cannot be written, ``DeadlineExceeded`` past the deadline, the socket's or
        ``http.client``'s error for a transport failure."""
        parts = urlsplit(self.url(path))
        port = parts.port or (443 if parts.scheme == "https" else 80)
        endpoint = _Endpoint(parts.scheme, parts.hostname or "", port)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        headers = {"Range": f"bytes={start}-{end - 1}"}
        watched: list[int | None] = []  # the watchdog's tokens of this request's sockets
        try:
            resp = self._request(endpoint, target, headers, deadline_at, watched)
            try:
                return self._receive(resp, start, end, fd, endpoint)
            except BaseException:
                self._drop(endpoint)
                raise
        finally:
            for token in watched:
                _WATCHDOG.release(token)

    def _request(
        self,
        endpoint: _Endpoint,
        target: str,
        headers: dict[str, str],
        deadline_at: float,
        watched: list[int | None],
    ) -> http.client.HTTPResponse:
        """Send the GET on this thread's connection to ``endpoint`` (its socket watched until
        ``deadline_at``); a kept-alive connection the server closed meanwhile is replaced once,
        at once (not an attempt of the retry policy)."""
        for fresh in (False, True):
            if time.monotonic() >= deadline_at:
                raise DeadlineExceeded("the part's deadline passed")
            conn, reused = self._connection(endpoint, fresh)
            watched.append(_WATCHDOG.watch(conn.sock, deadline_at))
            try:
                conn.request("GET", target, headers=headers)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._drop(endpoint)
                if not reused:
                    raise
            except BaseException:
                self._drop(endpoint)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _receive(
        self, resp: http.client.HTTPResponse, start: int, end: int, fd: int, endpoint: _Endpoint
    ) -> int:
        want = end - start
        if resp.status >= 300:
            body = resp.read(_ERROR_BODY_MAX)
            self._drop(endpoint)
            error = _status_error(resp.status, resp.reason, body)
            if resp.status in REFUSED:
                raise RouteRefused(str(error)) from error
            raise error
        length = resp.getheader("Content-Length")
        sent = int(length) if length is not None and length.isdigit() else None
        if resp.status != 206 and not (start == 0 and sent == want):
            # a 200 is the whole object, which is more than asked (unless the range was all of it;
            # without a length, more as far as anyone knows): the server ignores Range
            self._drop(endpoint)
            return sent if sent is not None else want + 1
        if sent is not None and sent != want:
            self._drop(endpoint)
            return sent
        where = resp.getheader("Content-Range", "")
        if resp.status == 206 and where and not where.startswith(f"bytes {start}-"):
            self._drop(endpoint)  # another range than asked, of the right length: not our bytes
            raise ConnectionError(f"asked for bytes {start}-{end - 1}, the answer says {where!r}")
        view = self._buffer()
        got = 0
        while got < want:
            n = resp.readinto(view[: min(CHUNK, want - got)])
            if not n:
                break
            try:
                pwrite_all(fd, view[:n], start + got)
            except OSError as exc:
                raise LocalWriteError(f"writing bytes {start + got}.. of the copy: {exc}") from exc
            got += n
        if got < want:
            self._drop(endpoint)
        return got

    def _buffer(self) -> memoryview:
        view = getattr(self._local, "buffer", None)
        if view is None:
            view = self._local.buffer = memoryview(bytearray(CHUNK))
        return view

    def _connection(self, endpoint: _Endpoint, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to ``endpoint`` (made here after a fork: a socket shared with
        the parent would interleave two processes' responses), and whether it was kept alive."""
        pool = getattr(self._local, "pool", None)
        if pool is None or self._local.pid != os.getpid():
            pool = self._local.pool = {}
            self._local.pid = os.getpid()
        conn = None if fresh else pool.get(endpoint)
        if conn is not None:
            return conn, True
        if endpoint.scheme == "https":
            conn = http.client.HTTPSConnection(
                endpoint.host, endpoint.port, timeout=self.connect_s, context=self._ssl_context()
            )
        else:
            conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=self.connect_s)
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(self.read_s)
        pool[endpoint] = conn
        return conn, False

    def _ssl_context(self) -> ssl.SSLContext:
        """The TLS settings botocore would use (made once: loading the CA store costs ~20-50 ms)."""
        with self._urls_lock:
            if self._ssl is None:
                if isinstance(self._verify, str):
                    self._ssl = ssl.create_default_context(cafile=self._verify)
                elif self._verify is False:
                    self._ssl = ssl._create_unverified_context()  # noqa: S323 - the user turned it off
                else:
                    self._ssl = ssl.create_default_context()
            return self._ssl

    def _drop(self, endpoint: _Endpoint) -> None:
        pool = getattr(self._local, "pool", None)
        if pool is not None and self._local.pid == os.getpid():
            conn = pool.pop(endpoint, None)
            if conn is not None:
                conn.close()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` written to ``fd`` at ``offset`` (``pwrite`` may write less than asked)."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _status_error(status: int, reason: str, body: bytes) -> S3StatusError:
    """The S3 error document's ``Code`` and ``Message`` where the body is one (found by plain
    search: no XML parser meets a peer's bytes here)."""
    text = body.decode("utf-8", errors="replace")

    def element(name: str) -> str:
        lo = text.find(f"<{name}>")
        hi = text.find(f"</{name}>", lo + 1)
        return text[lo + len(name) + 2 : hi].strip()[:300] if 0 <= lo < hi else ""

    return S3StatusError(status, element("Code"), element("Message") or reason or f"HTTP {status}")


def route_for(fs: Any, connect_s: float, read_s: float) -> DirectRoute | None:
    """The direct route for ``fs``, or None where a presigned GET cannot say what its client
    would send: not s3fs, server-side-encryption keys or other extra request parameters,
    requester-pays, or proxies configured."""
    module = type(fs).__module__ or ""
    if not module.startswith("s3fs") or not callable(getattr(fs, "url", None)):
        return None
    if getattr(fs, "s3_additional_kwargs", None) or getattr(fs, "requester_pays", False):
        return None
    client = dict(getattr(fs, "client_kwargs", None) or {})
    config = dict(getattr(fs, "config_kwargs", None) or {})
    if client.get("proxies") or config.get("proxies"):
        return None
    if str(config.get("signature_version", "")) not in ("s3v4", "v4") and not getattr(fs, "anon", False):
        return None  # botocore would presign with SigV2 (remote.with_timeouts asks for SigV4)
    verify = client.get("verify", True)
    return DirectRoute(
        fs,
        connect_s=connect_s,
        read_s=read_s,
        verify=verify if isinstance(verify, str) else verify is not False,
    )


__all__ = [
    "CHUNK",
    "DeadlineExceeded",
    "DirectRoute",
    "LocalWriteError",
    "REFUSED",
    "RouteRefused",
    "S3StatusError",
    "pwrite_all",
    "route_for",
]
