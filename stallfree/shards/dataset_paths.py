"""File names a dataset's own index gives (MDS and LitData ``index.json``, Hugging Face
``state.json``), kept inside the dataset directory.

An index is data from elsewhere: it must not send us reading other files. A name that is
absolute or climbs out with ``..`` is refused by its spelling (``inside``); a name that is
spelled inside but is, or passes through, a symbolic link whose target lies outside the
directory is refused too (``refuse_link_out``: local files only, object stores have no links).
Links that stay inside the dataset are followed.
"""

from __future__ import annotations

import os
from typing import Any

from stallfree.shards.sources.base import SourceError


class OutsideDatasetError(SourceError, ValueError):
    """An index names a file outside its dataset directory (by path, or through a link);
    ``shard`` is the file named where known. A ``SourceError``: ``stallfree shard`` refuses
    the source, ``open_dataset`` the dataset."""


def inside(root: str, name: Any, where: str) -> str:
    """``root/name`` for a file name an index lists, refused if it is not a plain relative path
    inside ``root``."""
    if not isinstance(name, str) or not name:
        raise OutsideDatasetError(f"{where}: a shard entry has no file name")
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm == ".." or norm.startswith(".." + os.sep) or "\0" in name:
        raise OutsideDatasetError(f"{where}: shard file {name!r} is outside the dataset directory")
    return os.path.join(root, norm)


def refuse_link_out(root: str, path: str, where: str) -> None:
    """Refuse local ``path`` (under ``root``) when a symbolic link on the way to it leads out of
    ``root``: names the link and where it points. A missing file is left to the reader."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real == real_root or os.path.commonpath([real_root, real]) == real_root:
        return
    link, target = _first_link(root, path)
    raise OutsideDatasetError(
        f"{where}: {link} is a symbolic link to {target!r}, which resolves to {real}, outside the "
        f"dataset directory {real_root} (links may only point inside the dataset)",
        shard=path,
    )


def _first_link(root: str, path: str) -> tuple[str, str]:
    """The first path component under ``root`` that is a symbolic link, and its target."""
    rel = os.path.relpath(path, root)
    current = root
    for part in rel.split(os.sep):
        current = os.path.join(current, part)
        if os.path.islink(current):
            return current, os.readlink(current)
    if os.path.islink(root):  # (the root itself is not what leads out: kept for the message)
        return root, os.readlink(root)
    return path, os.path.realpath(path)


__all__ = ["OutsideDatasetError", "inside", "refuse_link_out"]
