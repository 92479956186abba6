"""Shard paths a ``manifest.json`` (or its binary sidecar) lists, kept inside the dataset.

A manifest is data from elsewhere: a downloaded dataset, a bucket someone else writes. Its shard
paths are joined onto the manifest's directory (``manifest.join``), which keeps an absolute path
or a URL as it is and lets ``..`` climb out, so one hostile entry could point every read (and
``stallfree verify``'s hashing, a rewrite's clean-up) at any file the process may open. Our
writers only ever record paths relative to the dataset's directory, so a path that is absolute,
a URL, has a ``..`` component, a backslash or a NUL is refused by its spelling, naming the entry.
Symbolic links under a local dataset are ``dataset_paths.py``'s concern.
"""

from __future__ import annotations

import numpy as np

from stallfree.errors import ManifestError


def path_problem(path: str) -> str | None:
    """Why shard path ``path`` may not be read relative to a dataset directory, or None."""
    if path.startswith("/"):
        return "is absolute"
    if "://" in path:
        return "is a URL"
    if "\\" in path or "\0" in path:
        return "holds a backslash or a NUL"
    if ".." in path.split("/"):
        return "climbs out of the dataset directory with '..'"
    return None


def check_shard_path(path: str, where: str, entry: int | None = None) -> None:
    """Raise ``ManifestError`` naming manifest ``where`` and the entry unless ``path`` is a plain
    relative path inside the dataset directory."""
    problem = path_problem(path)
    if problem is not None:
        which = f"shard {entry} ({path!r})" if entry is not None else f"shard {path!r}"
        raise ManifestError(
            f"{where}: {which} {problem}; shard paths must be relative to the manifest's directory",
            shard=path,
        )


def check_path_blob(blob: bytes | memoryview, offsets: np.ndarray, where: str) -> None:
    """``check_shard_path`` for every path of a sidecar's ``paths`` section (cut at ``offsets``):
    one scan of the whole blob, entry by entry only when something looks wrong."""
    data = bytes(blob)
    starts = offsets[:-1].astype(np.int64)  # every path is non-empty (checked before)
    looks_wrong = any(mark in data for mark in (b"..", b"://", b"\\", b"\0")) or bool(
        np.any(np.frombuffer(data, np.uint8)[starts] == ord("/")) if starts.size else False
    )
    if not looks_wrong:
        return
    for j in range(len(starts)):
        path = data[int(offsets[j]) : int(offsets[j + 1])].decode("utf-8", "replace")
        check_shard_path(path, where, j)


__all__ = ["check_path_blob", "check_shard_path", "path_problem"]
