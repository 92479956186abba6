"""The C heap of loader processes (glibc): keep freed batch memory, or give it back at the end
of a burst. Elsewhere than glibc every function here does nothing.

``keep_freed_memory`` -- why: every batch the loader hands over holds fresh Python objects (a raw
sample's ``bytes``, ~100 KB each), which the training step frees a moment later. glibc's malloc returns free memory at the
top of a heap to the kernel once it exceeds its trim threshold (128 KiB until the process has
freed a large ``mmap``-ed block), so the next batch's objects page-faulted their memory in again,
zeroed: in a ``perf`` profile of warm epochs over staged S3 shards (``bench_s3_netns.py``), page
faults and page clearing were a fifth of the training process's CPU, and a warm epoch took 0.15-0.18
s where the same process, having once freed an 8 MiB block, took 0.10 s.

glibc raises its thresholds itself when a process frees an ``mmap``-ed block (mallopt(3), "dynamic
mmap threshold"): the mmap threshold becomes that block's size and the trim threshold twice it.
``keep_freed_memory`` frees one such block, untouched, so the process adapts as if it had done
that already; it is what any process that once held a large buffer runs with. A user's own
``M_MMAP_THRESHOLD`` / ``M_TRIM_THRESHOLD`` (``mallopt``, ``MALLOC_*_`` or ``GLIBC_TUNABLES``)
turns the adaptation off, and then this changes nothing. Elsewhere than glibc: nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# the block freed: batch objects up to this size are then served from the heap, and up to twice it
# of free memory stays there (glibc adapts only to blocks of at most 32 MiB on 64-bit systems)
BLOCK_BYTES = 16 << 20

_done_in: int | None = None  # the pid that did it (a forked child inherits the thresholds)
_lock = threading.Lock()


def keep_freed_memory(block_bytes: int = BLOCK_BYTES) -> bool:
    """Have glibc keep up to ``2 * block_bytes`` of freed memory (once per process); returns
    whether it was done now (False: done before, or not glibc)."""
    global _done_in
    with _lock:
        if _done_in == os.getpid() or not sys.platform.startswith("linux"):
            return False
        _done_in = os.getpid()
        try:
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # noqa: B018 - glibc's own symbol: musl and others adapt differently
        except (OSError, AttributeError):
            return False
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        block = libc.malloc(block_bytes)  # mmap-ed (over the threshold) and never touched: no page is used
        if not block:
            return False
        libc.free(block)
        log.debug("freed a %d-byte block: glibc keeps freed memory up to twice that", block_bytes)
        return True


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 << 20  # glibc's upper limit for the mmap threshold on 64-bit


def retain_freed_memory(trim_bytes: int = 256 << 20, mmap_bytes: int = _MMAP_MAX) -> bool:
    """Raise glibc's trim and mmap thresholds; returns False (and changes nothing) off glibc.

    Why: batched reads (``get_many``) allocate and free a batch of samples every step; with
    glibc's defaults the next batch page-faulted its memory in again (``benchmarks/bench_read.py``:
    5-13x slower than single reads). Process-wide, so nothing calls it implicitly; up to
    ``trim_bytes`` of freed memory stays in the process's RSS."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, min(mmap_bytes, _MMAP_MAX))) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_bytes)
    )
    log.debug("glibc mallopt trim=%d mmap=%d: %s", trim_bytes, mmap_bytes, ok)
    return ok


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``).

    Samples of a few hundred KiB are malloc'ed from the heap once glibc's dynamic mmap threshold
    has risen past them; a small long-lived allocation made after a burst (a slot made for kept
    batches) then pins the freed space above it, and a worker's RSS crept by about one sample per
    epoch (measured: +256 KiB/epoch per worker for 60 epochs of 256 KiB samples while the
    consumer kept whole epochs; flat with ``malloc_trim`` or a fixed threshold). Called when a
    burst is over, so it costs nothing per batch.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
