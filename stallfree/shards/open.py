"""``open_dataset(url)``: a map-style dataset over tar or Arrow shards on any fsspec filesystem.

Global index ``i`` -> (shard, row) through the manifest's cumulative counts (bisect), then the
shard's reader (opened by its format, ``formats.py``: ``tar/reader.py``, ``arrow/reader.py``) fetches the row: ``pread``
(tar) or a memory map (Arrow) locally, ranged reads remotely. Shards are opened lazily on first use and checked cheaply then.

Without a manifest (a directory of tars, a glob, a brace pattern ``data-{000..009}.tar``) the
index is built on the fly from the tar headers (or ``.idx`` files beside them), with a warning
that says how to write one. Table files users already have open the same way: a Hugging Face
``save_to_disk`` directory (Arrow *stream* files) or Parquet files (``data/train-*.parquet``);
so do MosaicML MDS and LitData directories (an ``index.json``), through the read-only formats of
``inplace.py``. A ``DatasetDict`` directory names its splits.
"""

from __future__ import annotations

import logging
import operator
import os
import posixpath
import shlex
import threading
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import fsspec

from stallfree.errors import ManifestError, MissingShardError, ShardError, ShardReadError
from stallfree.shards import formats
from stallfree.shards.formats import Format, ShardOpen, ShardReader
from stallfree.shards.manifest.model import FORMAT_VERSION, MANIFEST_NAME, Manifest, join
from stallfree.shards.scan import INDEX_JSON, resolve_at
from stallfree.shards.verify import verify_manifest
from stallfree.storage import remote
from stallfree.storage.fs import Location, is_local
from stallfree.storage.jsonfile import parse_json

log = logging.getLogger(__name__)

_ITER_CHUNK = 64


def open_dataset(
    url: str, *, verify_hashes: bool = False, verify_samples: bool = False, **storage_options: Any
) -> ShardedDataset:
    """Open a dataset: a directory with ``manifest.json`` (or the manifest's URL), or shards
    without one (tars, Arrow / Parquet files: directory, glob, brace pattern, single file), or an
    MDS / LitData directory read in place (or its ``index.json``). ``verify_hashes`` checks each
    shard's sha256 against the manifest when it is first used (reads the whole shard once);
    ``verify_samples`` checks every member read against the CRC32 recorded when it was written
    (``sums.py``; a ``ChecksumMismatchError`` names the sample), for tar datasets that have them."""
    # the URL resolved once, here; every step below is handed it (it was looked up four times)
    where = Location.of(url, **storage_options)
    fs = where.fs
    try:
        scanned = None
        manifest = _remote_manifest(where)
        if manifest is not None:
            root, paths = where.path.rstrip("/"), None
        else:
            _, root, paths = resolve_at(where)
            if paths is None:
                manifest = Manifest.load(root, fs=fs)
            else:
                manifest, scanned = _manifest_for_files(fs, root, paths)
    except PermissionError as exc:
        raise denied(url, exc, url) from None
    except MissingShardError:
        _check_bucket(where)
        raise
    fmt = formats.get_format(manifest.format, where=url)
    if paths is not None:
        log.warning(
            "%s has no manifest.json: indexed %d shard(s) (%d samples) on the fly. %s",
            url,
            len(manifest.shards),
            manifest.samples,
            _advice(url, fmt, is_local(fs)),
        )
    if verify_samples and (fmt.checksums is None or not manifest.checksums):
        raise ManifestError(
            f"{url}: verify_samples=True needs the per-sample checksums `stallfree shard` records for "
            f"tar shards, and this {manifest.format} dataset has none (Arrow shards, tars written by "
            "other tools or older versions, or indexed with `stallfree index`): re-shard it with "
            "`stallfree shard`, or pass verify_hashes=True to check each shard's sha256",
            shard=MANIFEST_NAME,
        )
    fs_url = fs.unstrip_protocol(root or "/")
    return ShardedDataset(
        url,
        manifest,
        root,
        fs_url,
        storage_options,
        verify_hashes,
        scanned,
        fs=fs,
        verify_samples=verify_samples,
    )


def _advice(url: str, fmt: Format, local: bool) -> str:
    """How to open it instantly next time, by format: ``stallfree index`` writes a manifest beside
    the shards of an ``indexable`` format (tars; for tables it stops with "no .tar shards");
    the others get one by re-sharding, and ``stallfree shard`` reads local files."""
    src = shlex.quote(url)
    reshard = getattr(fmt, "reshard_format", None)  # a format read in place: what it shards to
    if reshard is not None:
        return (
            "Read in place (no sha256, every shard's index.json entry checked when it opens); "
            f"`stallfree shard {src if local else 'LOCAL_COPY'} DST` writes {reshard} shards "
            "with a manifest (byte-equal samples) that open instantly."
        )
    if fmt.indexable:
        return (
            f"Write one with `stallfree index {src}` (or re-shard with `stallfree shard`) "
            "to open it instantly."
        )
    if not local:
        src = "LOCAL_COPY"
    return (
        "To open it instantly, "
        + ("copy it to a local path, then " if not local else "")
        + f"re-shard it once with `stallfree shard {src} DST --format arrow` and open DST "
        "(it has a manifest)."
    )


def denied(url: str, exc: BaseException, shard: str) -> ShardReadError:
    """The error for a refused read: the store answered, and said no (not a missing or bad shard)."""
    return ShardReadError(
        f"access denied reading {url}: {exc or type(exc).__name__} (check the credentials, e.g. "
        "storage_options key/secret or AWS_ACCESS_KEY_ID, and the bucket's policy)",
        shard=shard,
    )


def _remote_manifest(where: Location) -> Manifest | None:
    """A remote directory URL's manifest, read with one GET, or None (not remote, not a plain
    directory URL, or no manifest there: ``resolve_at`` then looks for shards).

    Why: ``resolve_at`` asks whether ``manifest.json`` exists before it is read, and each request
    is a round trip to the store (the first to a new client also makes its connection): the
    HEADs cost a training run's first batch ~50-70 ms at 10 ms each way for nothing the GET does
    not say."""
    url = where.url
    if "{" in url or any(c in url for c in "*?[") or url.endswith((".json", *formats.scan_suffixes())):
        return None
    if "://" not in url or url.startswith("file://") or where.local:
        return None
    try:
        return Manifest.load(join(where.path.rstrip("/"), MANIFEST_NAME), fs=where.fs)
    except MissingShardError:
        return None


def _check_bucket(where: Location) -> None:
    """On an object store (a filesystem with buckets), a missing bucket says so, rather than the
    plainer "no dataset at URL" that would send the user looking for a wrong prefix."""
    try:
        fs = where.fs
        split = getattr(fs, "split_path", None)
        if split is None or is_local(fs):
            return
        bucket = split(where.path.split("{", 1)[0])[0]
        exists = bool(bucket) and fs.exists(bucket)
    except Exception as exc:  # noqa: BLE001 - botocore's errors are not OSErrors
        if isinstance(exc, OSError | ValueError) or remote.is_transport_error(exc):
            return  # the original error stands
        raise
    if not exists:
        raise MissingShardError(f"bucket {bucket!r} does not exist (opening {where.url})", shard=where.url)


def _manifest_for_files(
    fs: fsspec.AbstractFileSystem, root: str, paths: list[str]
) -> tuple[Manifest, list[Any] | None]:
    """A manifest for shard files that have none, made by the one format they all belong to
    (an ``index.json``: the read-only format whose index it is, MDS or LitData)."""
    if len(paths) == 1 and posixpath.basename(paths[0]) == INDEX_JSON:
        fmt = _in_place_format(fs, paths[0])
    else:
        fmt = formats.format_of_files(paths)
    if fmt is None:
        raise ShardError(f"a dataset without a manifest must be {formats.scan_choices()} files: {paths[:5]}")
    found = fmt.scan(fs, root, paths)
    manifest = Manifest(
        FORMAT_VERSION, fmt.name, found.fields, found.shards, classes=found.classes, extra=found.extra
    )
    return manifest, found.indices


def _in_place_format(fs: fsspec.AbstractFileSystem, path: str) -> Format:
    """The read-only format (``formats.read_only_formats``: MDS, LitData) whose index ``path``
    is; a ``ShardError`` naming the file when it is none of them."""
    where = path if is_local(fs) else fs.unstrip_protocol(path)
    obj = parse_json(remote.read_file(fs, path, shard=INDEX_JSON), where)
    for fmt in formats.read_only_formats():
        if fmt.accepts(obj):  # type: ignore[attr-defined]
            return fmt
    known = ", ".join(f"{f.what}" for f in formats.read_only_formats())  # type: ignore[attr-defined]
    raise ShardError(
        f"{where} is not an index open_dataset reads ({known}: a 'shards' list, or 'chunks' and "
        "'config'); make a dataset of the directory with `stallfree shard`",
        shard=INDEX_JSON,
    )


def _manifest_state(manifest: Manifest) -> Any:
    """A manifest as pickled state: its JSON, or, for a read-only format's manifest (built here
    from an ``index.json``, never a ``manifest.json``, which ``Manifest.from_json`` refuses to
    name such a format), the object itself (its shards are a plain list)."""
    if manifest.format not in formats.format_names():
        return manifest
    return manifest.to_json()


class ShardedDataset:
    """Map-style dataset over a manifest's shards. Picklable: pickles its URL, options and
    manifest (plus any on-the-fly index); files are reopened lazily in each process."""

    def __init__(
        self,
        url: str,
        manifest: Manifest,
        root: str,
        fs_url: str,
        storage_options: dict[str, Any],
        verify_hashes: bool = False,
        scanned: list[Any] | None = None,
        *,
        fs: fsspec.AbstractFileSystem | None = None,
        verify_samples: bool = False,
    ) -> None:
        self.url = url
        self.manifest = manifest
        self.verify_hashes = verify_hashes
        self.verify_samples = verify_samples
        self._root = root
        self._fs_url = fs_url
        self._storage_options = dict(storage_options)
        self._scanned = scanned
        self.shard_sizes: list[int] = manifest.sample_counts()
        starts, total = [], 0
        for n in self.shard_sizes:
            starts.append(total)
            total += n
        self._starts = starts
        self._len = total
        self._setup(fs)

    def _setup(self, fs: fsspec.AbstractFileSystem | None) -> None:
        # where the shards are: the filesystem open_dataset made, or (unpickled, forked) one
        # made again from the root's URL on first use
        self._where = Location(self._fs_url, self._root, self._storage_options, fs)
        self._pid = os.getpid()
        self._readers: list[ShardReader | None] = [None] * len(self.shard_sizes)
        self._open_lock = threading.Lock()
        self._opening: dict[int, Future] = {}  # shards being opened ahead (warm), under _open_lock
        self._local = fs is not None and is_local(fs)

    @property
    def fingerprint(self) -> str:
        """Stable hex id of the dataset's content (cache keys use it). Computed once: with 200,000
        shards it hashes ~20 MB of text, and the loader asks for it several times per iterator."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            fp = self._fingerprint = self.manifest.fingerprint
        return fp

    @property
    def format(self) -> str:
        return self.manifest.format

    def key_of(self, index: int) -> str | None:
        """The ``__key__`` of sample ``index`` without reading the sample (the cache checks a
        cached raw sample against it, ``cache/expect.py``): from a tar shard's index (the ``.idx``
        or scanned headers; a local shard is opened for it, a remote one only if already open: a
        warm epoch should make no requests), or a local Arrow IPC file's key column. None where
        telling would take a request to storage."""
        s, row = self.locate(index)
        if self._scanned is not None:  # the format's own index: only the format reads it
            in_index = getattr(formats.get_format(self.manifest.format, where=self.url), "key_in_index", None)
            if in_index is not None:
                return in_index(self._scanned[s], row)
        reader = self._readers[s]  # (a parent's index is still right after fork)
        if reader is None:
            if not is_local(self.fs):
                return None
            reader = self._reader(s)
        return reader.key_of(row)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        fs = self._where.fs
        self._local = is_local(fs)
        return fs

    def shard_path(self, s: int) -> str:
        return join(self._root, self.manifest.shards[s].path)

    def locate(self, index: int) -> tuple[int, int]:
        """Global index -> (shard number, row in shard)."""
        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sample index {index} out of range for a dataset of {self._len}")
        s = bisect_right(self._starts, i) - 1  # empty shards share a start; bisect skips past them
        return s, i - self._starts[s]

    def _check_fork(self) -> None:
        if not self._local and self._pid != os.getpid():
            self._setup(None)  # forked: remote clients do not survive fork

    def _reader(self, s: int) -> ShardReader:
        self._check_fork()
        reader = self._readers[s]
        if reader is not None:
            return reader
        with self._open_lock:
            ahead = self._opening.get(s)
        if ahead is not None:  # being opened ahead (warm): wait for that open, not a second one
            ahead.result()
            reader = self._readers[s]
            if reader is not None:
                return reader
        with self._open_lock:
            reader = self._readers[s]
            if reader is None:
                reader = self._open_reader(s, self.verify_hashes)
                self._readers[s] = reader
        return reader

    def _open_reader(self, s: int, verify_hash: bool) -> ShardReader:
        info = self.manifest.shards[s]
        path, fs = self.shard_path(s), self.fs
        fmt = formats.get_format(self.manifest.format, where=self.url)
        request = ShardOpen(
            fs,
            path,
            info,
            index=self._scanned[s] if self._scanned is not None else None,
            verify_hash=verify_hash,
            verify_samples=self.verify_samples,
        )
        try:
            return fmt.open_reader(request)
        except PermissionError as exc:
            raise denied(fs.unstrip_protocol(path), exc, info.path) from None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        s, row = self.locate(index)
        reader = self._readers[s] if self._local else None
        if reader is None:
            reader = self._reader(s)
        return reader.get(row)

    def warm(self, shards: Sequence[int], executor: Executor) -> None:
        """Start opening ``shards`` on ``executor`` (those not open or being opened); returns at once.

        Opening a shard costs requests (its index, a size check): over an object store, a batch
        spanning ``window`` shards cost ``window`` round trips in a row, and every block boundary
        a 300-440 ms spike (the loader's fetch thread now opens queued tasks' shards ahead). A
        failed open ahead is forgotten: the read opens the shard again and raises the real error.
        """
        self._check_fork()
        self.fs  # noqa: B018 - resolve the filesystem once, before threads use it
        with self._open_lock:
            for s in dict.fromkeys(int(x) for x in shards):
                if self._readers[s] is None and s not in self._opening:
                    self._opening[s] = executor.submit(self._open_ahead, s)

    def _open_ahead(self, s: int) -> None:
        try:
            reader = self._open_reader(s, self.verify_hashes)
        except Exception:  # noqa: BLE001 - the read itself opens it again and raises the real error
            log.debug("opening shard %d ahead failed", s, exc_info=True)
            reader = None
        with self._open_lock:
            self._opening.pop(s, None)
            if reader is not None and self._readers[s] is None:
                self._readers[s] = reader
                return
        if reader is not None:
            reader.close()

    def _read_rows(self, s: int, rows: list[int]) -> list[dict[str, Any]]:
        return self._reader(s).get_many(rows)

    def shards_of(self, indices: Sequence[int]) -> list[int]:
        """The shards holding ``indices``, each once, in first-use order."""
        return list(dict.fromkeys(self.locate(int(i))[0] for i in indices))

    def get_many(self, indices: Sequence[int], executor: Executor | None = None) -> list[dict[str, Any]]:
        """Samples for ``indices`` in order; reads are grouped by shard and neighbours coalesced.

        With ``executor`` the shards a batch needs are opened concurrently first, then read
        concurrently, one task per shard (remote stores: a batch then costs about one round trip,
        not one per shard)."""
        by_shard: dict[int, tuple[list[int], list[int]]] = {}
        for pos, index in enumerate(indices):
            s, row = self.locate(index)
            group = by_shard.get(s)
            if group is None:
                group = by_shard[s] = ([], [])
            group[0].append(pos)
            group[1].append(row)
        out: list[Any] = [None] * len(indices)
        if executor is not None and by_shard:
            self.warm(list(by_shard), executor)
            with self._open_lock:
                ahead = [self._opening[s] for s in by_shard if s in self._opening]
            for fut in ahead:  # here, not in the pool: a read waiting on a queued open would deadlock
                fut.result()
        if executor is None or len(by_shard) <= 1:
            for s, (positions, rows) in by_shard.items():
                for pos, sample in zip(positions, self._reader(s).get_many(rows), strict=True):
                    out[pos] = sample
            return out
        reads = {s: executor.submit(self._read_rows, s, rows) for s, (_, rows) in by_shard.items()}
        for s, (positions, _) in by_shard.items():
            for pos, sample in zip(positions, reads[s].result(), strict=True):
                out[pos] = sample
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """In order. Remote: batches of neighbours in one ranged read. Local: one sample at a time,
        so each sample's memory is freed before the next is read (holding a batch makes glibc hand
        memory back to the OS and fault it in again, which halved throughput when profiled)."""
        if self._len and not self._local:
            self._reader(0)  # resolves the filesystem, so _local is known
        if self._local:
            for s, size in enumerate(self.shard_sizes):
                if size:
                    yield from self._reader(s).iter_rows()
            return
        for start in range(0, self._len, _ITER_CHUNK):
            yield from self.get_many(range(start, min(self._len, start + _ITER_CHUNK)))

    def verify(self, hashes: bool = True) -> list[ShardError]:
        """Check every shard (``verify.verify_manifest``, what ``stallfree verify`` runs): present,
        size, sha256 (if ``hashes``), tar headers against the index this dataset reads through,
        sample counts, keys no earlier shard holds. Returns the problems found (empty list: all
        good); reads every shard in full."""
        return verify_manifest(
            self.fs, self._root, self.manifest, indices=self._scanned, hashes=hashes
        ).errors

    def close(self) -> None:
        for reader in self._readers:
            if reader is not None:
                reader.close()
        self._readers = [None] * len(self.shard_sizes)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "manifest": _manifest_state(self.manifest),
            "root": self._root,
            "fs_url": self._fs_url,
            "storage_options": self._storage_options,
            "verify_hashes": self.verify_hashes,
            "verify_samples": self.verify_samples,
            "scanned": self._scanned,
            # a format registered at run time, for processes that start without it (spawn, Ray)
            "format": (self.manifest.format, formats.portable_ref(self.manifest.format)),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        scanned = state["scanned"]  # each shard's index, as its format made it (pickled as is)
        name, ref = state.get("format", (None, None))
        if ref is not None:
            formats.adopt(name, ref)
        manifest = state["manifest"]
        if not isinstance(manifest, Manifest):
            manifest = Manifest.from_json(manifest, where=state["url"])
        self.__init__(  # type: ignore[misc]
            state["url"],
            manifest,
            state["root"],
            state["fs_url"],
            state["storage_options"],
            state["verify_hashes"],
            scanned,
            verify_samples=state.get("verify_samples", False),
        )

    def __repr__(self) -> str:
        m = self.manifest
        return f"ShardedDataset({self.url!r}, format={m.format}, samples={self._len}, shards={len(m.shards)})"


__all__ = ["ShardedDataset", "open_dataset"]
