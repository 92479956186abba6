"""What a cached raw sample must look like before the loader is handed it as the sample it asked for.

An entry can be intact (its codec checksum holds) and still not be the sample: written by another
version of the program, by a buggy map function under the raw stage, or planted by anyone who can
reach an unauthenticated cache server. Handing such a value on crashes collate far from the cause
or, worse, trains on it. ``RawSampleCheck`` compares each decoded entry with what the dataset
yields: a dict with a non-empty ``__key__`` (equal to the dataset's key for that index where the
dataset can tell it without reading, ``dataset.key_of(index)``), only fields the manifest names,
each of a type the shard format produces. A mismatch raises ``UnexpectedValue`` (a
``codec.UnexpectedEntry``), which the cache treats like a corrupt entry: a miss, and deleted
(counted under ``mismatched`` too). The entry's own identity (``codec.Identity``) is checked by
the cache itself, for every stage; this check adds what only the dataset knows.

Which datasets tell keys (``key_of``): ``ShardedDataset`` (tar: from the shard's index, opened if
need be where that is a local read; Arrow IPC files: the ``__key__`` column, locally), a mixture
(its source's key for the position in the current epoch). Token windows have no keys: their
entries are checked by identity and type alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stallfree.cache.base import CacheKey
from stallfree.cache.codec import UnexpectedEntry
from stallfree.shards.formats import find_format

log = logging.getLogger(__name__)

KEY = "__key__"

# what codec.decode can give back for a dict field (JSON fields come back as lists and dicts)
ANY_FIELD: tuple[type, ...] = (bytes, str, int, float, bool, type(None), np.ndarray, list, dict)


class UnexpectedValue(UnexpectedEntry):
    """An intact cache entry that is not what the loader asked for."""


def arrow_field_types(arrow_type: str) -> tuple[type, ...]:
    """The Python types ``shards.arrow.row_converter`` yields for a column of ``arrow_type``
    (``str(pa.DataType)``, as the manifest keeps it); nulls are always allowed."""
    t = arrow_type.strip()
    if t in ("binary", "large_binary") or t.startswith("fixed_size_binary"):
        return (bytes, type(None))
    if t in ("string", "large_string", "utf8", "large_utf8"):
        return (str, type(None))
    if t.startswith(("int", "uint")):
        return (int, type(None))
    if t in ("halffloat", "float", "double"):
        return (float, type(None))
    if t == "bool":
        return (bool, type(None))
    if t.startswith(("list<", "large_list<")):
        inner = t.split(":", 1)[-1].rstrip(">").strip()
        if inner.startswith(("int", "uint")) or inner in ("halffloat", "float", "double", "bool"):
            return (np.ndarray, type(None))
    return ANY_FIELD


@dataclass(frozen=True)
class RawSampleCheck:
    """``check(key, value)`` for entries of the ``raw`` stage; raises ``UnexpectedValue``.

    ``fields``: the field names the dataset has (``None``: not known, any name). ``types``: the
    allowed Python types per field (a field not listed: ``default_types``). ``require_key``: a
    sample must carry ``__key__`` (manifest datasets always do). ``key_of``: the dataset's key for
    an index, or ``None`` where it cannot tell without reading storage.
    """

    fields: frozenset[str] | None = None
    types: Mapping[str, tuple[type, ...]] = field(default_factory=dict)
    default_types: tuple[type, ...] = ANY_FIELD
    require_key: bool = False
    key_of: Callable[[int], str | None] | None = None

    def __call__(self, key: CacheKey, value: Any) -> None:
        if not isinstance(value, dict):
            raise UnexpectedValue(f"a raw sample is a dict of fields, the entry holds {type(value).__name__}")
        if KEY in value or self.require_key:
            sample_key = value.get(KEY)
            if not isinstance(sample_key, str) or not sample_key:
                raise UnexpectedValue(f"'__key__' must be a non-empty str, the entry has {sample_key!r}")
            expected = self._expected_key(key.index)
            if expected is not None and sample_key != expected:
                raise UnexpectedValue(
                    f"the entry holds sample {sample_key!r}, sample {key.index} is {expected!r}"
                )
        for name, v in value.items():
            if name == KEY:
                continue
            if self.fields is not None and name not in self.fields:
                raise UnexpectedValue(f"field {name!r} is not one of the dataset's fields")
            allowed = self.types.get(name, self.default_types)
            if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
                want = ", ".join(t.__name__ for t in allowed)
                raise UnexpectedValue(f"field {name!r} is {type(v).__name__}, the dataset gives {want}")

    def _expected_key(self, index: int) -> str | None:
        """The dataset's key for ``index``, or None when it cannot tell (or fails to: the entry's
        identity still names the index; a read of the sample would report the dataset's error)."""
        if self.key_of is None:
            return None
        try:
            return self.key_of(index)
        except Exception as exc:  # noqa: BLE001 - a check must not turn a cache hit into a crash
            log.debug("key_of(%d) failed: %s: %s", index, type(exc).__name__, exc)
            return None


def raw_check(dataset: Any) -> RawSampleCheck:
    """The check for ``dataset``'s raw samples: exact for a manifest-backed dataset of a registered
    shard format (``shards.formats``; tar: every field bytes; Arrow, ``typed_fields``: per column
    type), a dict with a str ``__key__`` if any for other datasets."""
    key_of = getattr(dataset, "key_of", None)
    manifest = getattr(dataset, "manifest", None)
    fmt = find_format(getattr(manifest, "format", None))
    names = getattr(manifest, "fields", None)
    if fmt is None or not isinstance(names, list):
        return RawSampleCheck(key_of=key_of)
    fields = frozenset(names) if names else None
    if not fmt.typed_fields:
        return RawSampleCheck(fields, default_types=(bytes,), require_key=True, key_of=key_of)
    types = {n: arrow_field_types(t) for n, t in (getattr(manifest, "field_types", None) or {}).items()}
    return RawSampleCheck(fields, types, require_key=True, key_of=key_of)
