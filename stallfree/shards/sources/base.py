"""What every sample source shares: the ``Source`` protocol (list cheaply, read lazily), the
``Item`` it lists, its errors, and the file helpers (walking a tree, key and field names).

A source lists its items first, cheaply (paths and sizes, no contents), so the sharder can plan
shard boundaries deterministically before any byte is read; contents are read lazily, in any
process, through ``read_many`` (sources pickle as their paths and listing). Local paths only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.errors import ShardError
from stallfree.shards.tar.walk import sample_parts

log = logging.getLogger(__name__)

_SPACE = re.compile(r"\s")


class SourceError(ShardError):
    """The source cannot be used as given (unknown layout, no samples, conflicting fields)."""


class SourceReadError(SourceError):
    """A source file could not be read; ``path`` names it."""

    def __init__(self, message: str, *, path: str, key: str | None = None, offset: int | None = None) -> None:
        self.path = str(path)
        super().__init__(f"cannot read source file {path}: {message}", key=key, offset=offset)
        self.reason = message

    def __reduce__(self):
        return (_rebuild_read_error, (self.reason, self.path, self.key, self.offset))


def _rebuild_read_error(reason: str, path: str, key: str | None, offset: int | None) -> SourceReadError:
    return SourceReadError(reason, path=path, key=key, offset=offset)


@dataclass(frozen=True, slots=True)
class Item:
    """One future sample, as listed: a label for messages, field sizes for planning, and a
    source-specific reference used to read it. ``sizes`` are exact for files and tar members and
    an estimate (row-group or batch average) for table rows."""

    name: str
    sizes: tuple[int, ...]
    ref: Any

    @property
    def size(self) -> int:
        return sum(self.sizes)


def normalize_field(ext: str) -> str:
    """Field name from a file extension: lower case, no dot, ``jpeg`` -> ``jpg``."""
    ext = ext.lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


def split_key_field(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the base name; ``("", "")``
    for a name that is not sample data. The tar readers' rule (``tar_walk.sample_parts``)."""
    return sample_parts(name) or ("", "")


def safe_key(stem: str) -> str:
    """Sample keys may hold no dot after the last '/' (WebDataset reads the first dot as the
    start of the field) and no whitespace; those characters become '_'."""
    head, _, base = stem.rpartition("/")
    if "." in base:
        base = base.replace(".", "_")
    out = f"{head}/{base}" if head else base
    return _SPACE.sub("_", out) if _SPACE.search(out) else out


def read_file(path: str, key: str | None = None) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SourceReadError(f"{type(exc).__name__}: {exc.strerror or exc}", path=path, key=key) from exc


class Source:
    """Base: ``items()`` lists what will become samples; ``read_many`` yields, for each item in
    order, a sample dict or the ``SourceReadError`` that prevented reading it (so the caller
    applies its error policy). ``skipped`` lists files already found unreadable while listing."""

    kind = "source"
    # Items listed grouped (an ImageFolder lists one class after another): sharded shuffled by
    # default (``parallel.resolve_shuffle``), or shards come out near-single-class.
    grouped = False

    def __init__(self) -> None:
        self.classes: list[str] | None = None
        self.skipped: list[dict[str, str]] = []
        self._items: list[Item] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_items"] = None  # workers get their items with each job; the listing may be huge
        return state

    def items(self) -> list[Item]:
        if self._items is None:
            self._items = self._list()
        return self._items

    def _list(self) -> list[Item]:
        raise NotImplementedError

    def read_many(self, items: Sequence[Item]) -> Iterator[dict[str, Any] | SourceReadError]:
        for item in items:
            try:
                yield self.read(item)
            except SourceReadError as exc:
                yield exc

    def read(self, item: Item) -> dict[str, Any]:
        raise NotImplementedError

    def _skip_or_raise(self, on_error: str, path: str, exc: BaseException) -> None:
        err = exc if isinstance(exc, SourceReadError) else SourceReadError(str(exc), path=path)
        if on_error == "raise":
            raise err
        log.warning("skipping %s", err)
        where = err.where  # the sample and byte offset, where known: a skip names what was lost
        self.skipped.append(
            {"source": str(path), "error": f"{err.reason} ({where})" if where else err.reason}
        )


def walk_files(root: Path) -> Iterator[str]:
    """Regular-file paths under ``root`` (relative, '/'-separated), sorted, hidden entries skipped."""
    for dirpath, dirnames, filenames in os.walk(root, onerror=None, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if not name.startswith("."):
                yield name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"


def stat_size(path: str, on_error: str, source: Source) -> int | None:
    try:
        st = os.stat(path)
    except OSError as exc:
        source._skip_or_raise(
            on_error, path, SourceReadError(f"{type(exc).__name__}: {exc.strerror}", path=path)
        )
        return None
    return st.st_size
