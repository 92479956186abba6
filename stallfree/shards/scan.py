"""Facts about shard files, and indexes for tars that came without one: ``sha256_of``, ``record_mismatches`` (size and hash against the manifest), URL patterns
(``resolve``), and ``scan_tar``: the tar headers walked by ``tar_walk`` (memory-mapped locally,
small ranged reads remotely) and grouped into samples, exactly as DALI's ``wds2idx`` and
WebDataset do (members ``KEY.FIELD``; consecutive members with one key form a sample).

``manifest_for_tars`` builds a manifest for existing tars (``open_dataset`` on the fly;
``indexing.index_tars``, ``stallfree index``, writes it with the ``.idx`` files); ``scan_tar``
walks one tar.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
from collections.abc import Callable, Sequence
from typing import Any

import fsspec

from stallfree.errors import CorruptShardError, HashMismatchError, MissingShardError, ShardError
from stallfree.shards import formats
from stallfree.shards.arrow.hf import DATASET_DICT_FILE, SAVE_TO_DISK_FILES, splits_of_dataset_dict
from stallfree.shards.dataset_paths import refuse_link_out
from stallfree.shards.manifest.model import FORMAT_VERSION, MANIFEST_NAME, Manifest, ShardInfo
from stallfree.shards.tar.idx import IdxSample, idx_path_for, parse_idx, render_idx
from stallfree.shards.tar.walk import RangeReader, group_samples, walk_tar
from stallfree.storage import remote, stamps
from stallfree.storage.digests import ShardDigests
from stallfree.storage.fs import Location, file_size, is_local

log = logging.getLogger(__name__)

SHARD_MISSING = "shard not found"  # a shard file named by a manifest or pattern that is not there
INDEX_JSON = "index.json"  # MosaicML MDS's and LitData's index: a dataset read in place (inplace.py)


def scan_tar(fs: fsspec.AbstractFileSystem, path: str, shard: str | None = None) -> list[IdxSample]:
    """Walk a tar's headers -> samples in order (``tar_walk``). Raises CorruptShardError /
    DuplicateKeyError naming the shard, the key and the byte offset of the bad header."""
    shard = shard or posixpath.basename(path)
    reader = RangeReader(fs, path, file_size(fs, path, shard=shard, missing=SHARD_MISSING), shard)
    try:
        return list(group_samples(walk_tar(reader, shard), shard))
    finally:
        reader.close()


def record_mismatches(info: ShardInfo, size: int, digest: str | None = None) -> list[ShardError]:
    """How a shard's size (and, if ``digest`` is given, its sha256) differ from its manifest record:
    the one rule, and wording, the readers (which raise the first) and ``verify`` (which lists
    all) apply. Empty when they agree."""
    found: list[ShardError] = []
    if size != info.bytes:
        what = "truncated" if size < info.bytes else "larger than recorded"
        found.append(
            CorruptShardError(
                f"shard is {what}: {size} bytes on storage, the manifest says {info.bytes}",
                shard=info.path,
                offset=size,
            )
        )
    if digest is not None and info.sha256 and digest != info.sha256:
        found.append(
            HashMismatchError(f"sha256 is {digest}, the manifest says {info.sha256}", shard=info.path)
        )
    return found


def sha256_of(
    fs: fsspec.AbstractFileSystem,
    path: str,
    chunk: int = 8 << 20,
    size: int | None = None,
    shard: str | None = None,
) -> str:
    """Stream a file through sha256 (whole file: used only where hashes are asked for). Remote
    files are read in checked ``chunk``-byte ranges (``remote.read_range``): a body cut short
    would otherwise hash as a mismatch that blames the shard; ``size`` saves looking it up."""
    if is_local(fs):
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    h = hashlib.sha256()
    _stream(fs, path, h.update, chunk, size, shard)
    return h.hexdigest()


def digests_of(
    fs: fsspec.AbstractFileSystem,
    path: str,
    chunk: int = 8 << 20,
    size: int | None = None,
    shard: str | None = None,
) -> ShardDigests:
    """A file's sha256 and xxh3-128 (``digests.py``) in one pass, read as ``sha256_of`` reads."""
    digests = ShardDigests()
    if is_local(fs):
        with open(path, "rb", buffering=0) as f:
            buf = memoryview(bytearray(chunk))
            while n := f.readinto(buf):
                digests.update(buf[:n])
        return digests
    _stream(fs, path, digests.update, chunk, size, shard)
    return digests


def _stream(
    fs: fsspec.AbstractFileSystem,
    path: str,
    update: Callable[[bytes], None],
    chunk: int,
    size: int | None,
    shard: str | None,
) -> None:
    name = shard or posixpath.basename(path)
    total = file_size(fs, path, shard=name, missing=SHARD_MISSING) if size is None else size
    for start in range(0, total, chunk):
        update(remote.read_range(fs, path, start, min(total, start + chunk), shard=name))


# -- patterns -------------------------------------------------------------------------------


def resolve(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str, list[str] | None]:
    """URL -> (fs, root, shard paths or None): ``resolve_at`` of the URL resolved now."""
    return resolve_at(Location.of(url, **storage_options))


def resolve_at(where: Location) -> tuple[fsspec.AbstractFileSystem, str, list[str] | None]:
    """A resolved URL -> (fs, root, shard paths or None). None means ``root`` holds (or is) a
    manifest; a directory without one yields the files every format opens without one
    (``Format.scan_suffixes``: WebDataset tars, Arrow IPC files or streams, Parquet), not its
    subdirectories'; a brace pattern the files it names (on ``where``'s filesystem: no lookup per
    file). A remote store that cannot be asked (dead endpoint, 5xx) is a ``RemoteReadError``
    naming the endpoint or status, not "no dataset at URL" nor the client library's own exception."""
    fs, url = where.fs, where.url
    if "{" in url:
        paths = where.expand()
        return fs, _common_root(paths), paths
    try:
        return _resolve_path(fs, where.path, url)
    except (ShardError, FileNotFoundError, PermissionError):
        raise
    except Exception as exc:
        if is_local(fs) or not remote.is_transport_error(exc):
            raise
        raise remote.unreachable(url, fs, exc) from None


def _resolve_path(
    fs: fsspec.AbstractFileSystem, path: str, url: str
) -> tuple[fsspec.AbstractFileSystem, str, list[str] | None]:
    if any(c in path for c in "*?[") and not fs.exists(path):
        paths = sorted(fs.glob(path))
        if not paths:
            raise MissingShardError(f"no files match {url}", shard=url)
        return fs, _common_root(paths), paths
    if posixpath.basename(path) == INDEX_JSON:  # an MDS / LitData index, read in place
        return fs, posixpath.dirname(path), [path]
    if path.endswith(".json"):
        return fs, posixpath.dirname(path), None
    suffixes = formats.scan_suffixes()
    if path.endswith(suffixes):
        return fs, posixpath.dirname(path), [path]
    # before isdir: http has no directories; a server error here is an error, not "no dataset"
    if remote.exists(fs, posixpath.join(path, MANIFEST_NAME), shard=MANIFEST_NAME):
        return fs, path.rstrip("/"), None
    if not fs.isdir(path):
        raise MissingShardError(f"no dataset at {url}", shard=url)
    root = path.rstrip("/")
    listing = sorted(fs.ls(path, detail=False))
    entries = {posixpath.basename(p.rstrip("/")) for p in listing}
    if DATASET_DICT_FILE in entries:
        raise dataset_dict_error(fs, root, url)
    if INDEX_JSON in entries:
        return fs, root, [posixpath.join(root, INDEX_JSON)]
    names = [p for p in listing if p.endswith(suffixes)]
    if not names:
        listed = ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]
        raise MissingShardError(
            f"{url} has no manifest.json and no {listed} files, nor an index.json: it is none of "
            "the layouts open_dataset reads (stallfree or WebDataset shards, Arrow / Parquet "
            "tables, a Hugging Face save_to_disk directory, MosaicML MDS, LitData). Make a dataset "
            f"of it with `stallfree shard {url} DST` (ImageFolder trees, files grouped by name, "
            "JSONL, ...), then open DST",
            shard=url,
        )
    if is_local(fs) and SAVE_TO_DISK_FILES[1] in entries:  # a save_to_disk directory's state.json
        for name in names:
            refuse_link_out(root, name, f"{url} ({SAVE_TO_DISK_FILES[1]})")
    return fs, root, names


def dataset_dict_error(fs: fsspec.AbstractFileSystem, root: str, url: str) -> ShardError:
    """What opening a ``DatasetDict.save_to_disk`` directory says: it holds splits, name them."""
    path = posixpath.join(root, DATASET_DICT_FILE)
    try:
        splits = splits_of_dataset_dict(remote.read_file(fs, path, shard=DATASET_DICT_FILE))
    except (ShardError, ValueError):
        splits = []
    example = posixpath.join(url.rstrip("/"), splits[0] if splits else "train")
    return ShardError(
        f"{url} is a Hugging Face DatasetDict with splits {', '.join(splits) or '(none listed)'}: "
        f"open one split directory, e.g. {example}",
        shard=DATASET_DICT_FILE,
    )


def resolve_files(
    urls: Sequence[str], **storage_options: Any
) -> tuple[fsspec.AbstractFileSystem, str, list[str]]:
    """Several file URLs (one filesystem: the first one's) -> (fs, their deepest common directory, paths)."""
    fs, first = remote.url_to_fs(urls[0], **storage_options)
    paths = [first] + [remote.url_to_fs(u, **storage_options)[1] for u in urls[1:]]
    return fs, _common_root(paths), paths


def _common_root(paths: list[str]) -> str:
    """The deepest directory holding all ``paths`` (shard paths in the manifest are relative to it)."""
    dirs = sorted({posixpath.dirname(p) for p in paths})
    if len(dirs) == 1:
        return dirs[0]
    return posixpath.commonprefix([d + "/" for d in dirs]).rsplit("/", 1)[0]


def relative(root: str, path: str) -> str:
    if root and path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1 :]
    return path


def manifest_for_tars(
    fs: fsspec.AbstractFileSystem,
    root: str,
    paths: list[str],
    *,
    hashes: bool = False,
    use_idx: bool = True,
    progress: Callable[[str, int], None] | None = None,
    stamp_shards: bool = False,
) -> tuple[Manifest, list[list[IdxSample]]]:
    """Manifest (+ each shard's samples) for existing tars; an ``.idx`` beside a tar is trusted
    when ``use_idx`` (it is checked against the tar on first use), else headers are scanned.
    ``stamp_shards`` records each shard's ``stamps.stamp`` (the store's version of the file and
    its index's hash), so the fingerprint of a dataset opened without a manifest changes when a
    shard changes in place (a manifest written to disk does without: its sha256 say it)."""
    shards, indices, fields, unversioned = [], [], {}, []
    for path in paths:
        rel = relative(root, path)
        samples = idx_bytes = None
        if use_idx:
            try:
                idx_bytes = remote.read_file(fs, idx_path_for(path), shard=rel)
                samples = parse_idx(idx_bytes, rel)
            except MissingShardError:
                samples = None
        if samples is None:
            samples = scan_tar(fs, path, rel)
        mark = None
        if stamp_shards:
            size, version = stamps.store_version(fs, path, rel)
            if version is None:
                unversioned.append(rel)
            mark = stamps.stamp(size, version, idx_bytes if idx_bytes is not None else render_idx(samples))
        else:
            size = file_size(fs, path, shard=rel, missing=SHARD_MISSING)
        for s in samples:
            for m in s.members:
                fields.setdefault(m[0], None)
        digests = digests_of(fs, path, size=size, shard=rel) if hashes else None
        shards.append(
            ShardInfo(
                rel,
                len(samples),
                size,
                digests.sha256() if digests is not None else None,
                stamp=mark,
                xxh3_128=digests.xxh3_128() if digests is not None else None,
            )
        )
        indices.append(samples)
        if progress is not None:
            progress(rel, size)
    stamps.warn_unversioned(fs.unstrip_protocol(root or "/"), unversioned)
    manifest = Manifest(FORMAT_VERSION, "tar", list(fields), shards)
    return manifest, indices


def check_record(
    fs: fsspec.AbstractFileSystem, path: str, size: int, info: ShardInfo | None, verify_hash: bool
) -> None:
    """The open-time checks both readers make: size against the manifest, then (if asked) sha256;
    raises the first mismatch (``scan.record_mismatches`` words it as ``verify`` does)."""
    if info is None:
        return
    found = record_mismatches(info, size)
    if not found and verify_hash and info.sha256:
        found = record_mismatches(info, size, sha256_of(fs, path, size=size, shard=info.path))
    if found:
        raise found[0]
