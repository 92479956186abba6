"""Existing tar shards (WebDataset layout) as a source: members listed from the tar headers by the
one tar walker (``tar_walk``, as every other tar reader here), read back by offset, so re-sharding
keeps every field byte-identical.

Nothing is lost in silence: a truncated or corrupt archive, a duplicate key, or a member name that
would escape the destination (absolute, or with a ``..`` part) follows ``on_error``: ``raise``
names the file, key and byte offset; ``skip`` keeps the samples before the bad spot and lists the
rest as skipped (in the summary and the manifest).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fsspec

from stallfree.errors import CorruptShardError, DuplicateKeyError
from stallfree.shards.sources.base import Item, Source, SourceError, SourceReadError
from stallfree.shards.tar.idx import IdxSample
from stallfree.shards.tar.walk import RangeReader, group_samples, walk_tar
from stallfree.shards.tar.writer import BLOCK

log = logging.getLogger(__name__)


def unsafe_name(name: str) -> bool:
    """True for a member name that must never be written: absolute, or with a ``..`` part (as
    ``tar -x`` would refuse it; a shard reader unpacking ours must not be led outside its folder)."""
    return name.startswith("/") or ".." in name.split("/")


class TarSource(Source):
    """Existing tar shards (WebDataset layout), re-sharded with byte-identical fields: members are
    listed from the tar headers, and read by offset."""

    kind = "tar"

    def __init__(self, paths: Sequence[str | Path], *, on_error: str = "raise") -> None:
        super().__init__()
        self.paths = [str(p) for p in paths]
        self.on_error = on_error
        self.root: str | None = None  # the directory they were listed from, if one was given

    def _list(self) -> list[Item]:
        items: list[Item] = []
        for ti, path in enumerate(self.paths):
            try:
                items.extend(self._list_tar(ti, path))
            except (OSError, SourceError) as exc:
                self._skip_or_raise(self.on_error, path, exc)
        return items

    def _list_tar(self, ti: int, path: str) -> list[Item]:
        """The tar's samples as items; a bad spot is handed to the error policy, and (if that
        skips) everything from it on is listed as skipped, the samples before it kept."""
        fs = fsspec.filesystem("file")
        reader = RangeReader(fs, path, os.path.getsize(path))
        items: list[Item] = []
        duplicates: list[DuplicateKeyError] = []
        try:
            for sample in group_samples(walk_tar(reader, path), path, on_duplicate=duplicates.append):
                problem = self._problem(path, sample, duplicates)
                duplicates.clear()
                if problem is not None:
                    self._skip_or_raise(self.on_error, path, problem)
                    continue
                fields = tuple((f, off, size) for f, off, size, _ in sample.members)
                sizes = tuple(size for _, _, size in fields)
                items.append(Item(f"{path}:{sample.key}", sizes, (ti, sample.key, fields)))
        except CorruptShardError as exc:
            lost = exc.reason + (
                "; this sample and every one after it are left out"
                if exc.key
                else "; every sample is left out"
            )
            self._skip_or_raise(
                self.on_error, path, SourceReadError(lost, path=path, key=exc.key, offset=exc.offset)
            )
        finally:
            reader.close()
        return items

    @staticmethod
    def _problem(path: str, sample: IdxSample, duplicates: list[DuplicateKeyError]) -> SourceReadError | None:
        """Why ``sample`` cannot be re-sharded (a duplicate, an unsafe member name), or None."""
        if duplicates:
            dup = duplicates[0]
            return SourceReadError(dup.reason, path=path, key=dup.key, offset=dup.offset)
        for _, off, _, name in sample.members:
            if unsafe_name(name):
                return SourceReadError(
                    f"member name {name!r} is absolute or has a '..' part; refusing to copy it",
                    path=path,
                    key=sample.key,
                    offset=off - BLOCK,
                )
        return None

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        handles: dict[int, Any] = {}
        try:
            for item in items:
                ti, key, fields = item.ref
                path = self.paths[ti]
                try:
                    f = handles.get(ti)
                    if f is None:
                        f = handles[ti] = open(path, "rb")
                    sample: dict[str, Any] = {"__key__": key}
                    for ext, off, size in fields:
                        f.seek(off)
                        data = f.read(size)
                        if len(data) != size:
                            raise SourceReadError(
                                f"short read of {size} bytes", path=path, key=key, offset=off
                            )
                        sample[ext] = data
                    yield sample
                except OSError as exc:
                    yield SourceReadError(f"{type(exc).__name__}: {exc}", path=path, key=key)
                except SourceReadError as exc:
                    yield exc
        finally:
            for f in handles.values():
                f.close()

    def read(self, item: Item) -> dict[str, Any]:
        result = next(self.read_many([item]))
        if isinstance(result, SourceReadError):
            raise result
        return result
