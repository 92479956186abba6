"""``manifest.json``: what a dataset holds (format, fields, shards with counts, sizes and hashes).

JSON over fsspec, never pickle. Shard paths are relative to the manifest's directory, so a dataset
directory can be copied or uploaded as a whole; one read from a file that is absolute, a URL or
climbs out with ``..`` is refused (``manifest_paths.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec

from stallfree.errors import ManifestError, MissingShardError, WriteError
from stallfree.shards import formats
from stallfree.shards.manifest import rows as manifest_rows
from stallfree.shards.manifest import sidecar as manifest_sidecar
from stallfree.shards.manifest.paths import check_shard_path
from stallfree.shards.manifest.shard_info import ShardInfo
from stallfree.storage.jsonfile import JSONFileError, parse_json
from stallfree.storage.remote import read_file, url_to_fs

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
MAX_COUNT = (1 << 63) - 1  # a shard's samples and bytes are int64 wherever they are used
MAX_MANIFEST_BYTES = 1 << 31  # a manifest of ~10 million shards; past it, not a manifest

log = logging.getLogger(__name__)


@dataclass
class Manifest:
    """A dataset's table of contents. ``fields`` lists field names in first-seen order.

    ``field_types`` (Arrow only) maps field -> Arrow type string; ``classes`` is the label names
    (index = ``cls`` value) when the source had classes; ``skipped`` lists source items left out
    (``{"source": ..., "error": ...}``); ``transform`` says how samples were rewritten while
    sharding (``{"max_side": N, "quality": Q, "resample": ..., "resized": count}`` for
    ``stallfree shard --max-side``); ``checksums`` names the per-member checksum every tar shard
    has in a ``.sums`` sidecar (``"crc32"``, ``sums.py``; None: none recorded, as for datasets
    written before them or indexed with ``stallfree index``); ``extra`` keeps unknown top-level
    keys on round trips. ``shards`` is a list, or a read-only ``ShardTable`` when the manifest
    was read from its binary sidecar (``manifest_sidecar.py``).
    """

    version: int
    format: str
    fields: list[str]
    shards: Sequence[ShardInfo]
    classes: list[str] | None = None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    field_types: dict[str, str] | None = None
    transform: dict[str, Any] | None = None
    checksums: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        if isinstance(self.shards, manifest_sidecar.ShardTable):
            return self.shards.total_samples
        return sum(s.samples for s in self.shards)

    @property
    def bytes(self) -> int:
        if isinstance(self.shards, manifest_sidecar.ShardTable):
            return self.shards.total_bytes
        return sum(s.bytes for s in self.shards)

    def sample_counts(self) -> list[int]:
        """Every shard's sample count, in order (from the sidecar's column, when read from one)."""
        if isinstance(self.shards, manifest_sidecar.ShardTable):
            return self.shards.sample_counts()
        return [s.samples for s in self.shards]

    @property
    def fingerprint(self) -> str:
        """Stable hex id of the content: format, fields and every shard's path, count, size, hash
        (and stamp, for shards indexed on the fly: ``ShardInfo.stamp``)."""
        if isinstance(self.shards, manifest_sidecar.ShardTable):  # recorded when the sidecar was written
            known = self.shards.fingerprint_for(self.version, self.format, self.fields)
            if known is not None:
                return known
        # the sorted compact JSON of {version, format, fields, shards}, written directly (manifest_rows)
        text = manifest_rows.fingerprint_text(self.version, self.format, self.fields, self.shards)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def files(self, root: str) -> list[str]:
        """Every file the dataset reads under ``root`` besides the manifest: each shard and,
        beside a tar, its ``.idx`` (and ``.sums``). Used to keep a rewrite from touching the
        dataset it replaces."""
        out = []
        for s in self.shards:
            path = join(root, s.path)
            out.append(path)
            out.extend(self.sidecars(path))
        return out

    def sidecars(self, path: str) -> list[str]:
        """The files that go with shard ``path``, by the format (``formats.py``): a tar's ``.idx``
        and, with checksums, ``.sums``."""
        return formats.get_format(self.format, where=MANIFEST_NAME).sidecars(path, bool(self.checksums))

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = dict(self.extra)
        obj.update(
            {
                "version": self.version,
                "format": self.format,
                "fields": list(self.fields),
                "classes": self.classes,
                "skipped": list(self.skipped),
                "shards": [s.to_json() for s in self.shards],
            }
        )
        if self.field_types is not None:
            obj["field_types"] = dict(self.field_types)
        if self.transform is not None:
            obj["transform"] = dict(self.transform)
        if self.checksums is not None:
            obj["checksums"] = self.checksums
        return obj

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"

    @classmethod
    def from_json(
        cls, obj: Any, where: str = "manifest", shards: Sequence[ShardInfo] | None = None
    ) -> Manifest:
        """The manifest in JSON object ``obj``, checked; ``shards``, when given, stands for its
        ``shards`` list (a sidecar's table, checked when it was read)."""
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        version = obj.get("version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"{where}: unknown manifest format version {version!r} (this stallfree reads version "
                f"{FORMAT_VERSION}; upgrade stallfree or rewrite the dataset with `stallfree shard`)"
            )
        fmt = obj.get("format")
        if fmt not in formats.format_names():  # (registered formats: formats.py)
            raise ManifestError(
                f"{where}: unknown shard format {fmt!r} (expected one of {formats.choices()})"
            )
        fields = obj.get("fields")
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise ManifestError(f"{where}: 'fields' must be a list of strings")
        if shards is None:
            entries = obj.get("shards")
            if not isinstance(entries, list):
                raise ManifestError(f"{where}: 'shards' must be a list")
            shards = [_bounded(ShardInfo.from_json(s, where), where, j) for j, s in enumerate(entries)]
        _total_bounded(shards, where)
        classes = obj.get("classes")
        if classes is not None and not (
            isinstance(classes, list) and all(isinstance(c, str) for c in classes)
        ):
            raise ManifestError(f"{where}: 'classes' must be a list of strings or null")
        skipped = obj.get("skipped") or []
        if not isinstance(skipped, list):
            raise ManifestError(f"{where}: 'skipped' must be a list")
        field_types = obj.get("field_types")
        if field_types is not None and not isinstance(field_types, dict):
            raise ManifestError(f"{where}: 'field_types' must be an object")
        transform = obj.get("transform")
        _check_transform(transform, where)
        checksums = obj.get("checksums")
        known_sums = formats.get_format(fmt, where=where).checksums  # the format's, not tar's
        if checksums is not None and checksums != known_sums:
            knows = f"knows {known_sums!r}" if known_sums else "records none"
            raise ManifestError(
                f"{where}: unknown per-sample checksum {checksums!r} (for {fmt} shards this stallfree {knows})"
            )
        known = {
            "version",
            "format",
            "fields",
            "shards",
            "classes",
            "skipped",
            "field_types",
            "transform",
            "checksums",
        }
        return cls(
            version=version,
            format=fmt,
            fields=list(fields),
            shards=shards,
            classes=list(classes) if classes is not None else None,
            skipped=list(skipped),
            field_types=dict(field_types) if field_types is not None else None,
            transform=dict(transform) if transform is not None else None,
            checksums=checksums,
            extra={k: v for k, v in obj.items() if k not in known},
        )

    @classmethod
    def loads(cls, text: str | bytes, where: str = "manifest") -> Manifest:
        """The manifest in ``text`` (the bytes of file ``where``); ``ManifestError`` naming the
        file for anything else, JSON nested too deep to parse (a ``RecursionError`` before) and
        bytes that are not UTF-8 included (``jsonfile.parse_json``)."""
        try:
            obj = parse_json(text, where, max_bytes=MAX_MANIFEST_BYTES)
        except JSONFileError as exc:
            raise ManifestError(f"{where}: {exc.reason}", offset=exc.offset) from None
        return cls.from_json(obj, where)

    @classmethod
    def load(
        cls,
        url: str,
        fs: fsspec.AbstractFileSystem | None = None,
        *,
        sidecar: bool = True,
        **storage_options: Any,
    ) -> Manifest:
        """Read a manifest from ``url`` (a ``manifest.json`` file or a directory holding one).

        A big one (``manifest_sidecar.SIDECAR_MIN_BYTES``) is read through its binary sidecar
        when one made from it is beside it (``sidecar=False``: parse the JSON regardless)."""
        fs, path = _manifest_path(url, fs, storage_options)
        try:  # checked and retried like every remote read (shards.remote)
            text = read_file(fs, path, shard=MANIFEST_NAME)
        except MissingShardError:
            raise MissingShardError(f"no manifest at {path}", shard=MANIFEST_NAME) from None
        if sidecar and len(text) >= manifest_sidecar.SIDECAR_MIN_BYTES:
            found = _read_sidecar(fs, path, text)
            if found is not None:
                return cls.from_json(found.manifest, where=path, shards=found.shards)
        return cls.loads(text, where=path)

    def save(
        self,
        url: str,
        fs: fsspec.AbstractFileSystem | None = None,
        *,
        sidecar: bool = True,
        **storage_options: Any,
    ) -> str:
        """Write atomically to ``url`` (a ``.json`` path or a directory); returns the path written.
        A big manifest also gets its binary sidecar (after the JSON: the JSON is the commit
        point; a sidecar that could not be written only costs the next open its speed)."""
        from stallfree.storage.atomic import atomic_write_bytes

        fs, path = _manifest_path(url, fs, storage_options)
        data = self.dumps().encode()
        atomic_write_bytes(fs, path, data)
        if sidecar and len(data) >= manifest_sidecar.SIDECAR_MIN_BYTES:
            self._save_sidecar(fs, path, data)
        return path

    def _save_sidecar(self, fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
        from stallfree.storage.atomic import atomic_write_bytes

        side = manifest_sidecar.sidecar_path_for(path)
        try:
            body = manifest_sidecar.encode(self.to_json(), self.shards, self.fingerprint, data)
            atomic_write_bytes(fs, side, body)
        except Exception as exc:  # noqa: BLE001 - the manifest stands; a stale sidecar is detected
            log.warning("could not write %s (%s); %s opens from its JSON", side, exc, path)

    def check_written(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        """Before committing: every shard is in place with its recorded size (and a tar's ``.idx``
        beside it), or WriteError naming the first that is not."""
        for s in self.shards:
            path = join(root, s.path)
            size = _size_of(fs, path, s.path)
            if size != s.bytes:
                raise WriteError(f"{path} holds {size} bytes after writing {s.bytes}", shard=s.path)
            for sidecar in self.sidecars(path):
                _size_of(fs, sidecar, s.path)

    def commit(self, fs: fsspec.AbstractFileSystem, root: str, replacing: Manifest | None = None) -> str:
        """Make this manifest the dataset at ``root``: check its shards are written, write
        ``manifest.json`` atomically (the commit point: before it the old dataset is whole, after
        it this one), then remove the files of ``replacing`` that this manifest does not use.
        Returns the manifest's path. Raises WriteError (the old manifest untouched) if it cannot."""
        self.check_written(fs, root)
        path = join(root, MANIFEST_NAME)
        data = self.dumps().encode()
        try:
            self.save(path, fs=fs)
        except BaseException:
            if not _holds(fs, path, data):
                raise
            log.warning("%s was written, but finishing the write failed; the new dataset stands", path)
        if replacing is not None:
            remove_replaced(fs, root, replacing, self)
        return path


def _read_sidecar(fs: fsspec.AbstractFileSystem, path: str, text: bytes) -> manifest_sidecar.Sidecar | None:
    """The sidecar beside manifest ``path`` (whose bytes are ``text``), if there is one made
    from it; raises ``ManifestError`` if it is damaged."""
    side = manifest_sidecar.sidecar_path_for(path)
    try:
        data = read_file(fs, side, shard=posixpath.basename(side))
    except MissingShardError:
        log.debug("%s has no sidecar: parsing its JSON", path)
        return None
    return manifest_sidecar.decode(data, side, text)


def _bounded(info: ShardInfo, where: str, entry: int) -> ShardInfo:
    """A shard entry whose counts fit the 64-bit integers they are used as (a fuzzed
    ``"samples": 2**70`` was an ``OverflowError`` naming nothing) and whose path stays inside
    the dataset directory (``manifest_paths.py``)."""
    check_shard_path(info.path, where, entry)
    for name, value in (("samples", info.samples), ("bytes", info.bytes)):
        if value > MAX_COUNT:
            raise ManifestError(f"{where}: shard {info.path}: {name} {value} is not a plausible count")
    return info


def _total_bounded(shards: Sequence[ShardInfo], where: str) -> None:
    """The shards' samples add up to an int64 (each fits, 2 of 2**62 did not: ``len()`` of the
    dataset was an ``OverflowError`` naming nothing)."""
    if isinstance(shards, manifest_sidecar.ShardTable):
        total = shards.total_samples
    else:
        total = sum(s.samples for s in shards)
    if total > MAX_COUNT:
        raise ManifestError(f"{where}: its shards hold {total} samples in all, more than any dataset can")


def _check_transform(transform: Any, where: str) -> None:
    """``transform`` is null or an object whose size settings are integers in range."""
    if transform is None:
        return
    if not isinstance(transform, dict):
        raise ManifestError(f"{where}: 'transform' must be an object or null")
    for name, low, high in (("max_side", 1, None), ("quality", 1, 100), ("resized", 0, None)):
        if name not in transform:
            continue
        value = transform[name]
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < low
            or (high is not None and value > high)
        ):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise ManifestError(f"{where}: transform {name} must be an integer {bound}: {value!r}")


def _manifest_path(
    url: str, fs: fsspec.AbstractFileSystem | None, storage_options: dict[str, Any]
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the manifest file's path for ``url`` (a ``.json`` path or a directory)."""
    if fs is None:
        fs, path = url_to_fs(url, **storage_options)  # shards.remote's: with connect/read timeouts
    else:
        path = url
    if not path.endswith(".json"):
        path = join(path, MANIFEST_NAME)
    return fs, path


def join(root: str, rel: str) -> str:
    """Join a shard path onto a root path; absolute paths and URLs are kept as they are."""
    if rel.startswith("/") or "://" in rel or not root:
        return rel
    return root.rstrip("/") + "/" + rel


def _size_of(fs: fsspec.AbstractFileSystem, path: str, shard: str) -> int:
    try:
        return fs.size(path)
    except FileNotFoundError:
        raise WriteError(f"{path} is missing after it was written", shard=shard) from None
    except Exception as exc:  # noqa: BLE001 - any backend error: cannot confirm the file
        raise WriteError(f"cannot check {path}: {type(exc).__name__}: {exc}", shard=shard) from exc


def _holds(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Whether ``path`` now holds exactly ``data`` (a write that failed after its rename did land)."""
    try:
        return fs.cat_file(path) == data
    except Exception:  # noqa: BLE001 - unreadable: not committed as far as we can tell
        return False


def generation_stem(stem: str, generation: int) -> str:
    """A shard's stem in a rewrite's generation: ``shard-000000`` (0), ``shard-000000.g1`` (1), ...
    A rewrite takes the first generation whose names the dataset it replaces does not use, so the
    old files stay whole until the new manifest is committed."""
    return stem if generation == 0 else f"{stem}.g{generation}"


def files_in_use(fs: fsspec.AbstractFileSystem, root: str) -> tuple[Manifest | None, set[str]]:
    """The dataset already at ``root`` (None if none or unreadable) and the normalised paths a
    rewrite must not write to: its files, or every file there when its manifest cannot be read."""
    path = join(root, MANIFEST_NAME)
    if not fs.exists(path):
        return None, set()
    try:
        old = Manifest.load(path, fs=fs)
    except Exception as exc:  # noqa: BLE001 - unreadable: keep every file there, remove none
        log.warning("cannot read the manifest being replaced (%s); keeping every file in %s", exc, root)
        return None, {posixpath.normpath(p) for p in fs.ls(root, detail=False)}
    return old, {posixpath.normpath(p) for p in old.files(root)}


def remove_replaced(fs: fsspec.AbstractFileSystem, root: str, old: Manifest, new: Manifest) -> None:
    """After ``new`` is committed: remove ``old``'s files (directly under ``root``) that ``new`` does
    not use. A file that cannot be removed is left with a warning (the new dataset stands)."""
    keep = {posixpath.normpath(p) for p in new.files(root)}
    for s in old.shards:
        if "/" in s.path or "://" in s.path:
            continue  # not written by us in this directory
        path = join(root, s.path)
        for p in (path, *old.sidecars(path)):
            if posixpath.normpath(p) in keep:
                continue
            try:
                fs.rm_file(p)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001
                log.warning("could not remove %s of the replaced dataset: %s", p, exc)
