"""Shard formats by name: what a format provides (``Format``) and the registry the rest of
``shards/`` (and the cache's sample check, the CLI) asks instead of branching on a name.

Before this, formats were ``if fmt == "tar" ... else`` branches over nine files, and a third
format would silently have taken the Arrow branch. Now each format is one file with one object
that follows ``Format`` (``format_tar.py``, ``format_arrow.py``), named here by a
``"module:attribute"`` string and imported only when first asked for (fsspec's ``registry.py``
is the model, as for decode backends in ``gpu_decode/registry.py``), so the registry imports
none of them: the modules that dispatch through it (``open.py``, ``verify.py``, ``manifest.py``)
stay free of import cycles. A name nobody registered is an ``UnknownFormatError`` naming where
it was found and the formats there are; nothing falls back to a default format.

A new format is one file with a ``Format`` and one line in ``_FORMATS`` (or a
``register_format`` call from your own code, e.g. a test: ``tests/shards/test_formats.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import fsspec

from stallfree.errors import ManifestError
from stallfree.shards.manifest.shard_info import ShardInfo
from stallfree.shards.verify_report import KeyAt, ProgressFn, VerifyReport


class UnknownFormatError(ManifestError, ValueError):
    """A shard format name that no one registered (a manifest's ``format``, a writer's argument)."""


@dataclass(frozen=True)
class ShardOpen:
    """What opening one shard for reading needs: where it is, its manifest row, the index a
    dataset without a manifest built for it (``ScannedFiles.indices``: the format's own value,
    opaque to everything but the format that made it; tar's is its scanned headers; None: the
    format reads its own), and the checks asked for (``verify_hash``: its sha256 now; ``verify_samples``: every member read
    against the checksums recorded when it was written)."""

    fs: fsspec.AbstractFileSystem
    path: str
    info: ShardInfo
    index: Any = None
    verify_hash: bool = False
    verify_samples: bool = False


@dataclass(frozen=True)
class ShardCheck:
    """What verifying one shard needs (``verify.verify_manifest`` builds one per shard):
    ``index`` as in ``ShardOpen``; ``hashes``: compare the sha256; ``decode``: decode image
    fields; ``checksums``: the manifest's per-member checksum algorithm, or None."""

    fs: fsspec.AbstractFileSystem
    path: str
    info: ShardInfo
    index: Any = None
    hashes: bool = True
    decode: bool = False
    progress: ProgressFn | None = None
    checksums: str | None = None


@dataclass(frozen=True)
class ScannedFiles:
    """Files of one format described without a manifest (``open_dataset`` on a directory of
    shards): their manifest rows, fields in first-seen order, per-shard indices (tar: the
    scanned headers; None where the format reads its own; each opaque to all but the format, which
    gets it back in ``ShardOpen.index``; picklable, as datasets are), label names and extra
    manifest keys."""

    shards: list[ShardInfo]
    fields: list[str]
    indices: list[Any] | None = None
    classes: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Prepared(Protocol):
    """A sample checked and encoded for one format's writer, with the bytes it will take (so
    ``ShardWriter`` can start a new shard before writing it, encoding it once)."""

    nbytes: int


@runtime_checkable
class ShardFileWriter(Protocol):
    """Writes one shard (and its sidecars) under temp names, renamed into place on ``close``
    (``atomic.py``), so no half shard ever appears under its final name."""

    samples: int
    bytes: int
    fields: list[str]
    # the manifest's ``field_types`` (``Format.typed_fields``), and the column types later shards
    # of the dataset are written with; None for a format without either
    field_types: dict[str, str] | None
    schema: Any

    def write(self, sample: dict[str, Any]) -> int: ...

    def write_prepared(self, prepared: Any) -> int: ...

    def close(self) -> ShardInfo: ...

    def abort(self) -> None: ...


@runtime_checkable
class ShardReader(Protocol):
    """Random access to one shard's rows, each a sample dict ``{"__key__": ..., field: value}``."""

    def __len__(self) -> int: ...

    def get(self, row: int) -> dict[str, Any]: ...

    def get_many(self, rows: list[int]) -> list[dict[str, Any]]: ...

    def iter_rows(self) -> Iterator[dict[str, Any]]: ...

    def key_of(self, row: int) -> str | None: ...

    def close(self) -> None: ...


@runtime_checkable
class Format(Protocol):
    """One shard format: its facts and the operations on one shard.

    ``suffix``: the file suffix its writer gives a shard. ``scan_suffixes``: files
    ``open_dataset`` opens as this format without a manifest (empty: never). ``shard_overhead``:
    bytes a shard takes besides its samples (tar's end-of-archive blocks), for shard planning.
    ``checksums``: the per-member checksum algorithm every shard it writes carries (a manifest's
    ``checksums``), or None. ``typed_fields``: the manifest records each field's Arrow type
    (``field_types``) and a sample's fields hold values of those types; False: every field of a
    sample is bytes. ``indexable``: ``stallfree index`` writes a manifest for shards of this
    format that other tools wrote.

    Optional: ``key_in_index(index, row) -> str | None``, a row's key read from an index the
    format's ``scan`` made (``ShardedDataset.key_of`` then opens no shard for it)."""

    name: str
    suffix: str
    scan_suffixes: tuple[str, ...]
    shard_overhead: int
    checksums: str | None
    typed_fields: bool
    indexable: bool

    def sidecars(self, path: str, with_checksums: bool = True) -> list[str]:
        """The files beside shard ``path`` that belong to it (removed, staged and kept from a
        rewrite with it); ``with_checksums=False`` leaves out the per-member checksums file."""
        ...

    def item_cost(self, sizes: Sequence[int]) -> int:
        """Bytes a sample whose fields have ``sizes`` takes in a shard (for planning boundaries)."""
        ...

    def prepare(self, sample: dict[str, Any]) -> Prepared:
        """``sample`` checked and encoded once, for ``ShardFileWriter.write_prepared``."""
        ...

    def writer(
        self, path: str, fs: fsspec.AbstractFileSystem, *, schema: Any = None, overlap_hash: bool = False
    ) -> ShardFileWriter:
        """A writer of one shard at ``path``; ``schema``: column types (``typed_fields`` formats);
        ``overlap_hash``: hash the shard on a helper thread where the format can."""
        ...

    def source_schema(self, source: Any) -> Any:
        """The column types to write a sharding source's samples with (None: decided by the writer)."""
        ...

    def open_reader(self, request: ShardOpen) -> ShardReader:
        """A reader of one shard, checked cheaply (size against the manifest) as it opens."""
        ...

    def verify(self, check: ShardCheck, report: VerifyReport) -> list[KeyAt]:
        """Check one shard in full, adding what is wrong to ``report`` (and its counts); returns
        its samples' keys for the dataset-wide duplicate check."""
        ...

    def scan(self, fs: fsspec.AbstractFileSystem, root: str, paths: list[str]) -> ScannedFiles:
        """Describe files of this format (all with ``scan_suffixes``) that have no manifest."""
        ...


Ref = str | Format  # "package.module:attribute", or the format itself

_FORMATS: dict[str, Ref] = {
    "tar": "stallfree.shards.tar.format:TAR",
    "arrow": "stallfree.shards.arrow.format:ARROW",
}
# Formats ``open_dataset`` reads in place but nothing writes (``format_names``, ``choices`` and
# ``stallfree shard --format`` leave them out): datasets other libraries wrote (``inplace.py``).
_READ_ONLY: dict[str, Ref] = {
    "mds": "stallfree.shards.inplace.mds:MDS",
    "litdata": "stallfree.shards.inplace.litdata:LITDATA",
}


# what register_format was given, by name: carried by a pickled dataset to processes that never
# registered it (``portable_ref``, ``adopt``); the built-ins, which every process has, are not here
_REGISTERED: dict[str, Ref] = {}


def register_format(name: str, fmt: Ref, *, clobber: bool = False) -> None:
    """Add a shard format under ``name`` (a ``Format``, or ``"module:attribute"`` naming one).

    An existing name is an error unless ``clobber``: two packages silently fighting over one
    name would make what ``manifest.json``'s ``format`` means depend on import order."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a shard format name must be a non-empty string, got {name!r}")
    if name in _FORMATS and not clobber:
        raise ValueError(f"shard format {name!r} is already registered (pass clobber=True to replace it)")
    if not isinstance(fmt, str):
        if not isinstance(fmt, Format):
            raise TypeError(f"shard format {name!r}: {type(fmt).__name__} does not follow formats.Format")
        if fmt.name != name:
            raise ValueError(f"shard format registered as {name!r} calls itself {fmt.name!r}")
    _FORMATS[name] = fmt
    _REGISTERED[name] = fmt


def unregister_format(name: str) -> None:
    """Remove a format added with ``register_format`` (a test's toy format, when it is done)."""
    _FORMATS.pop(name, None)
    _REGISTERED.pop(name, None)


def portable_ref(name: str) -> Ref | None:
    """How another process can register the format ``name`` (what ``register_format`` was given:
    a ``"module:attribute"`` string, or the format object, pickled by its class), or None for a
    built-in one. Why: a loader's spawned workers (and Ray's) start with the built-ins only; a
    dataset of a format registered at run time carries this to them (``adopt``)."""
    return _REGISTERED.get(name)


def adopt(name: str, ref: Ref) -> None:
    """Register ``ref`` as ``name`` unless this process already has a format of that name (its
    own registration wins: it is the one its code chose)."""
    if name not in _FORMATS and name not in _READ_ONLY:
        register_format(name, ref)


def format_names() -> tuple[str, ...]:
    """Every registered name, in registration order (the built-ins first)."""
    return tuple(_FORMATS)


def choices(quote: bool = False) -> str:
    """The registered names for a message: ``tar, arrow``, or quoted ``'tar' or 'arrow'``."""
    if not quote:
        return ", ".join(_FORMATS)
    names = [repr(n) for n in _FORMATS]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" or {names[-1]}"


def get_format(name: str, *, where: str | None = None) -> Format:
    """The format registered as ``name`` (imported now); ``UnknownFormatError`` naming ``where``
    (the manifest, dataset or shard it came from) and the registered formats otherwise."""
    table = _READ_ONLY if isinstance(name, str) and name not in _FORMATS and name in _READ_ONLY else _FORMATS
    ref = table.get(name) if isinstance(name, str) else None
    if ref is None:
        raise UnknownFormatError(
            f"unknown shard format {name!r} (registered formats: {choices()}; a new one is added "
            "with stallfree.shards.formats.register_format)",
            shard=where,
        )
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        ref = table[name] = getattr(importlib.import_module(module), attr)
    return ref


def find_format(name: Any) -> Format | None:
    """The format registered as ``name``, or None (a dataset that is not ours has no format)."""
    return get_format(name) if isinstance(name, str) and (name in _FORMATS or name in _READ_ONLY) else None


def read_only_formats() -> tuple[Format, ...]:
    """The formats read in place only (MDS, LitData), each imported now."""
    return tuple(get_format(name) for name in _READ_ONLY)


def scan_suffixes() -> tuple[str, ...]:
    """Every suffix of a shard file ``open_dataset`` opens without a manifest (all formats)."""
    return tuple(s for name in _FORMATS for s in get_format(name).scan_suffixes)


def format_of_files(paths: Sequence[str]) -> Format | None:
    """The first format (in registration order) that opens every one of ``paths`` without a
    manifest, or None: one dataset is made of files of one format."""
    for name in _FORMATS:
        fmt = get_format(name)
        if fmt.scan_suffixes and all(p.endswith(fmt.scan_suffixes) for p in paths):
            return fmt
    return None


def scan_choices() -> str:
    """What a directory without a manifest may hold, for a message: ``all .tar or all .arrow / .parquet``."""
    kinds = [" / ".join(get_format(n).scan_suffixes) for n in _FORMATS if get_format(n).scan_suffixes]
    return " or ".join(f"all {k}" for k in kinds)


__all__ = [
    "Format",
    "adopt",
    "portable_ref",
    "Prepared",
    "ScannedFiles",
    "ShardCheck",
    "ShardFileWriter",
    "ShardOpen",
    "ShardReader",
    "UnknownFormatError",
    "choices",
    "find_format",
    "format_names",
    "format_of_files",
    "get_format",
    "read_only_formats",
    "register_format",
    "scan_choices",
    "scan_suffixes",
    "unregister_format",
]
