"""What a node's staging area holds, and clearing it: the library behind ``stallfree staging``.

Why its own module: ``staging.py`` keeps the area while a loader reads through it; this answers
a person looking at the disk ("what is in /tmp/stallfree-staging-0, how big, since when") and
frees it. Clearing takes the locks staging takes: a file some process pins (a reader's shared
``flock``) is never deleted, nor a file being written, and the node's running total is kept
right, so a loader running meanwhile keeps its cap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import unquote

from stallfree.storage.staging import StagingArea


@dataclass(frozen=True)
class NamespaceSummary:
    """One dataset's staged copies: ``fingerprint`` (the directory's name), the ``url`` its note
    records (None: staged before notes were written), ``bytes`` and ``files`` staged (files
    being written included), and ``last_use`` (seconds since the epoch; None if it is empty)."""

    fingerprint: str
    url: str | None
    bytes: int
    files: int
    last_use: float | None
    path: str


@dataclass(frozen=True)
class ClearResult:
    """What ``clear_staging`` did: files and bytes deleted, files kept because a process uses
    them (or is writing them), and the namespaces removed whole."""

    removed_files: int
    removed_bytes: int
    kept_in_use: int
    kept_bytes: int
    removed_namespaces: tuple[str, ...]


def list_staging(root: str) -> list[NamespaceSummary]:
    """The namespaces of the staging area at ``root``, most recently used first; [] if there
    is no area there. Raises ``StagingDirError`` for a root that is not safe (not read)."""
    area = _open(root)
    if area is None:
        return []
    try:
        out = []
        for q in area.namespaces():
            entries = area.entries(sweep=False, only=q)
            url = area.read_note(q).get("url")
            last = max((e.last_use_ns for e in entries), default=None)
            out.append(
                NamespaceSummary(
                    fingerprint=unquote(q),
                    url=url if isinstance(url, str) else None,
                    bytes=sum(e.size for e in entries),
                    files=len(entries),
                    last_use=None if last is None else last / 1e9,
                    path=f"{area.root}/{q}",
                )
            )
        return sorted(out, key=lambda s: s.last_use or 0.0, reverse=True)
    finally:
        area.close()


def clear_staging(
    root: str, *, older_than_s: float | None = None, dataset: str | None = None, now: float | None = None
) -> ClearResult:
    """Delete staged copies at ``root``: all, those not used for ``older_than_s`` seconds, and/or
    only the namespace of the dataset fingerprint ``dataset``. Files in use or being written
    stay; a namespace left empty is removed. KeyError if ``dataset`` names no namespace there."""
    if older_than_s is not None and older_than_s < 0:
        raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
    area = _open(root)
    if area is None:
        if dataset is not None:
            raise KeyError(dataset)
        return ClearResult(0, 0, 0, 0, ())
    try:
        namespaces = area.namespaces()
        if dataset is not None:
            namespaces = [q for q in namespaces if unquote(q) == dataset]
            if not namespaces:
                raise KeyError(dataset)
        cutoff = (
            None if older_than_s is None else ((now if now is not None else time.time()) - older_than_s) * 1e9
        )
        removed = removed_bytes = kept = kept_bytes = 0
        gone = []
        for q in namespaces:
            for e in area.entries(only=q):  # partial files of writers that died go here
                if cutoff is not None and e.last_use_ns > cutoff:
                    continue
                if not e.partial and area.evict(q, e.name):
                    removed, removed_bytes = removed + 1, removed_bytes + e.size
                else:
                    kept, kept_bytes = kept + 1, kept_bytes + e.size
            if area.remove_namespace_if_empty(q):
                gone.append(unquote(q))
        return ClearResult(removed, removed_bytes, kept, kept_bytes, tuple(gone))
    finally:
        area.close()


def _open(root: str) -> StagingArea | None:
    try:
        return StagingArea(root, cap_bytes=1 << 62, create=False)
    except FileNotFoundError:
        return None


__all__ = ["ClearResult", "NamespaceSummary", "clear_staging", "list_staging"]
