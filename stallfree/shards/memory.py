"""Keep freed sample memory in the process instead of handing it back to the OS (glibc only).

Why: a batch of samples (say 256 x 100 KB) is allocated, used and freed again every step. By
default glibc returns the freed top of the heap to the kernel (trim threshold 128 KiB) and serves
allocations over its mmap threshold with fresh mappings, so the next batch page-faults all of its
memory in again: in ``benchmarks/bench_read.py`` that made batched reads (``get_many``) 5-13x
slower than reading the same samples one at a time. Raising both thresholds lets the next batch
reuse the same pages.

This changes process-wide allocator settings, so nothing calls it implicitly: the loader (or a
user) calls it once per process (main and each worker). Costs: up to ``trim_bytes`` of freed
memory stays in the process's RSS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 << 20  # glibc's upper limit for the mmap threshold on 64-bit


def retain_freed_memory(trim_bytes: int = 256 << 20, mmap_bytes: int = _MMAP_MAX) -> bool:
    """Raise glibc's trim and mmap thresholds; returns False (and changes nothing) off glibc."""
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
