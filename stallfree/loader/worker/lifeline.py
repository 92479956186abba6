"""A worker process's tie to the main process that made it: it never outlives it.

An orphaned worker (its main process SIGKILLed by the OOM killer or a job scheduler) keeps its
memory, its shared slots and any GPU or file handles until someone kills it by hand; observed:
workers re-parented to pid 1 after the main process died while a worker waited in a blocking
call that never checked its parent. Two ties, either enough:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``. The kernel kills the worker the moment the
  thread that forked it ends, even while the worker is stuck in native code. Set only when that
  thread is the main process's main thread (the signal follows the forking *thread*: a loader
  iterated from a short-lived thread would otherwise lose its workers when that thread ends) and
  the worker's parent is the main process (not so under a fork server).
- Everywhere: a watchdog thread that checks once a second whether the main process is gone
  (:func:`main_process_gone`) and ends the worker with ``os._exit``; the idle task loop checks too
  (fetch.py).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 1.0
EXIT_CODE = 1  # a worker ended by its watchdog (its main process was gone)


def main_process_gone(start_method: str | None, parent_pid: int) -> bool:
    """Whether the process that made this worker has exited. The sentinel that multiprocessing
    gives every child (a pipe from its creator, at EOF once the creator is gone) is right under
    fork, spawn and forkserver alike; the parent pid is not: under a fork server the parent is the
    server. Under fork a sibling forked later may hold the pipe open too, so a changed parent pid
    (re-parented to init) also counts there."""
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        return True
    return start_method == "fork" and os.getppid() != parent_pid


def _set_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` through libc; False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        # the process's own symbols, libc's among them: find_library("c") runs ldconfig in a
        # subprocess, 6-17 ms of every worker's start measured (the first batch waits on it)
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        logger.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    return True


def _watch(start_method: str | None, parent_pid: int) -> None:
    stop = threading.Event()
    while not stop.wait(WATCH_INTERVAL_S):
        if main_process_gone(start_method, parent_pid):
            os._exit(EXIT_CODE)  # nothing left to hand a batch to; cleanup handlers could block


def bind_to_parent(start_method: str | None, parent_pid: int, forked_by_main_thread: bool) -> None:
    """Tie this worker process's life to its main process (see the module docstring). Call first
    thing in the worker; exits at once if the main process is already gone."""
    if forked_by_main_thread and start_method in ("fork", "spawn") and os.getppid() == parent_pid:
        _set_pdeathsig(signal.SIGKILL)
    if main_process_gone(start_method, parent_pid):  # died before the tie was made
        os._exit(EXIT_CODE)
    threading.Thread(
        target=_watch, args=(start_method, parent_pid), daemon=True, name="stallfree-lifeline"
    ).start()
