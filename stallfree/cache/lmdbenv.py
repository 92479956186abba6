"""Process-wide LMDB environments that stay correct across ``fork``.

LMDB allows one open environment per file per process, and a forked child must neither use nor
close its parent's environment: closing it there wipes the parent's reader slots in the shared
lock file (so a writer could recycle pages a parent reader still uses), and py-lmdb refuses to
open the same files again while the inherited handle exists. So every NodeCache of a process
shares one environment per path, and just before ``os.fork`` (DataLoader workers) the parent
waits for in-flight LMDB operations, closes its environments cleanly and reopens them lazily
afterwards; the child starts with none and opens its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

log = logging.getLogger(__name__)

_DB_NAMES = (b"data", b"meta", b"atime", b"order")
_FORK_WAIT_S = 10.0


@dataclass
class Handle:
    env: lmdb.Environment
    dbs: tuple[Any, ...]  # data, meta, atime, order
    generation: int
    refs: int = 0
    checked_at: float = 0.0

    def check_readers(self, every_s: float = 5.0) -> None:
        """Free reader slots of processes that died (killed workers), at most every ``every_s``:
        a stale slot would pin old pages and make the store grow without bound."""
        now = time.monotonic()
        if now - self.checked_at >= every_s:
            self.checked_at = now
            self.env.reader_check()


_cond = threading.Condition()
_active = 0
_forking = False
_generation = 0
_envs: dict[str, Handle] = {}


@contextmanager
def using() -> Iterator[None]:
    """Hold around every LMDB operation so a fork never closes an environment mid-use."""
    global _active
    with _cond:
        while _forking:
            _cond.wait()
        _active += 1
    try:
        yield
    finally:
        with _cond:
            _active -= 1
            if not _active:
                _cond.notify_all()


def generation() -> int:
    """Bumped whenever environments were closed for a fork: handles of older generations are stale."""
    return _generation


def acquire(path: str, map_size: int) -> Handle:
    """The process's environment for ``path`` (opened on first use); call inside ``using()``."""
    with _cond:
        handle = _envs.get(path)
        if handle is None:
            Path(path).mkdir(parents=True, exist_ok=True)
            env = lmdb.open(
                path,
                map_size=map_size,
                subdir=True,
                max_dbs=len(_DB_NAMES),
                max_readers=2048,
                readahead=False,
                meminit=False,
                sync=False,  # a cache: durable across process crashes (the OS has the pages), not power loss
                metasync=False,
            )
            handle = _envs[path] = Handle(env, tuple(env.open_db(n) for n in _DB_NAMES), _generation)
            handle.check_readers(0.0)  # free reader slots left by crashed processes
        elif handle.env.info()["map_size"] < map_size:
            handle.env.set_mapsize(map_size)
        handle.refs += 1
        return handle


def release(path: str, handle: Handle) -> None:
    """Drop one reference; the environment closes with its last user."""
    with _cond:
        current = _envs.get(path)
        if current is not handle:
            return  # stale (closed for a fork) or already gone
        handle.refs -= 1
        if handle.refs <= 0 and not _active:
            del _envs[path]
            handle.env.close()


def _close_all() -> None:
    global _generation
    if not _envs:
        return
    for handle in _envs.values():
        try:
            handle.env.close()
        except lmdb.Error as exc:
            log.warning("closing LMDB environment before fork: %s", exc)
    _envs.clear()
    _generation += 1


def _before_fork() -> None:
    global _forking
    _cond.acquire()
    if not _envs:
        return
    _forking = True
    deadline = time.monotonic() + _FORK_WAIT_S
    while _active and (left := deadline - time.monotonic()) > 0:
        _cond.wait(left)
    if _active:
        log.warning("forking while %d LMDB operations are still running; they will miss", _active)
    _close_all()


def _after_fork_parent() -> None:
    global _forking
    _forking = False
    _cond.notify_all()
    _cond.release()


def _after_fork_child() -> None:
    global _cond, _active, _forking
    _cond = threading.Condition()  # the inherited one is held by a thread that does not exist here
    _active = 0
    _forking = False
    _envs.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)
