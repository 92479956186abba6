"""``DaemonThreadPool``: a thread-pool executor whose threads never hold the interpreter open.

Why not ``concurrent.futures.ThreadPoolExecutor``: its workers are joined at interpreter exit
(``threading._register_atexit``), whatever ``shutdown(wait=False)`` was told. A download thread
stuck on a server that trickles a byte every 2 s (each gap under the read timeout) then kept the
training process alive after its loader had failed and the script had returned: 505 s later it
was still there (issue 36). Reads have a deadline now (``remote.Timeouts``), but a process that is
done with its data must not wait for it: threads here are daemon threads, abandoned at exit; the
download they were running is cut off with the process, and nothing half-written is published
(staged copies are renamed into place only once checked, ``staging.py``).

Same contract as ``ThreadPoolExecutor`` for what callers use: ``submit``, ``map``,
``shutdown(wait=, cancel_futures=)``, a context manager; threads start as work arrives, up to
``max_workers``, and are not shared across a fork (a pool made before one is unusable in the child,
as a ``ThreadPoolExecutor`` is: make another).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_STOP = None  # what a worker takes off the queue to end


class DaemonThreadPool(Executor):
    """Up to ``max_workers`` daemon threads named ``{thread_name_prefix}_{n}`` running submitted calls."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "stallfree-pool") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # released by a worker each time it waits for work
        self._names = itertools.count()
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._work, name=f"{self._prefix}_{next(self._names)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
            return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.put(_STOP)  # for the next worker
                return
            future, fn, args, kwargs = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the future, as ThreadPoolExecutor does
                    future.set_exception(exc)
                    del exc
                else:
                    future.set_result(result)
                    del result
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new work; with ``cancel_futures`` what has not started is cancelled; with ``wait``
        return once the running calls are done. Threads end when the queue is drained."""
        with self._lock:
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not _STOP:
                        item[0].cancel()
            self._shutdown = True
            self._queue.put(_STOP)  # one more is harmless: each worker puts it back for the next
            threads = list(self._threads)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


__all__ = ["DaemonThreadPool"]
