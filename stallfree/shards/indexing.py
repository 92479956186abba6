"""``stallfree index``: give existing WebDataset tars a DALI ``.idx`` each and a ``manifest.json``,
in one sequential pass per tar (the same pass hashes it), so they open by global index."""

from __future__ import annotations

import glob
import logging
import posixpath
from collections.abc import Callable, Sequence
from typing import Any

import fsspec

from stallfree.shards.atomic import atomic_write_bytes
from stallfree.shards.errors import ShardError, WriteError
from stallfree.shards.idx import IdxSample, idx_path_for, render_idx
from stallfree.shards.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, ShardInfo
from stallfree.shards.verify import _HashingReader, group_samples, walk_tar

log = logging.getLogger(__name__)


def _expand(fs: fsspec.AbstractFileSystem, paths: Sequence[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        if any(c in p for c in "*?["):
            out.extend(
                sorted(glob.glob(p)) if fs.protocol in ("file", ("file", "local")) else sorted(fs.glob(p))
            )
        elif fs.isdir(p):
            out.extend(sorted(q for q in fs.ls(p, detail=False) if q.endswith(".tar")))
        else:
            out.append(p)
    return list(dict.fromkeys(out))


def index_tar(fs: fsspec.AbstractFileSystem, path: str, rel: str) -> tuple[ShardInfo, list[str]]:
    """Write ``path``'s ``.idx``; returns its ShardInfo (with sha256) and fields in first-seen order.
    Raises the first problem found (corrupt, truncated, duplicate key) as a ShardError."""
    with fs.open(path, "rb", block_size=1 << 22) as f:
        reader = _HashingReader(f, None)
        members, _, problems = walk_tar(reader, rel)
    samples, dups = group_samples(members, rel)
    for p in problems + dups:
        raise _error(p)
    entries = []
    fields: dict[str, None] = {}
    for key, ms in samples:
        group = []
        for m in ms:
            field = m.name[len(key) + 1 :]
            fields.setdefault(field, None)
            group.append((field, m.offset, m.size, m.name))
        entries.append(IdxSample(key, group))
    atomic_write_bytes(fs, idx_path_for(path), render_idx(entries).encode())
    return ShardInfo(rel, len(samples), reader.pos, reader.sha.hexdigest()), list(fields)


def _error(problem: Any) -> ShardError:
    from stallfree.shards import errors

    cls = getattr(errors, problem.error, ShardError)
    return cls(problem.message, shard=problem.shard, key=problem.key, offset=problem.offset)


def index_tars(
    tars: Sequence[str],
    *,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    **storage_options: Any,
) -> dict[str, Any]:
    """Index tars (files, globs or a directory) that share a parent directory; write
    ``manifest.json`` there. Returns a summary dict."""
    if not tars:
        raise ValueError("no tar files given")
    fs, first = fsspec.core.url_to_fs(tars[0], **storage_options)
    paths = _expand(fs, [first, *(fsspec.core.url_to_fs(t, **storage_options)[1] for t in tars[1:])])
    if not paths:
        raise ValueError(f"no tar files found in {', '.join(tars)}")
    missing = [p for p in paths if not fs.exists(p)]
    if missing:
        from stallfree.shards.errors import MissingShardError

        raise MissingShardError(f"tar {missing[0]} does not exist", shard=posixpath.basename(missing[0]))
    roots = {posixpath.dirname(p) for p in paths}
    if len(roots) != 1:
        raise ValueError(f"index tars of one directory at a time (got {len(roots)} directories)")
    root = roots.pop()
    manifest_path = posixpath.join(root, MANIFEST_NAME)
    if fs.exists(manifest_path) and not overwrite:
        raise WriteError(f"{manifest_path} already exists; pass --overwrite (overwrite=True) to replace it")
    shards: list[ShardInfo] = []
    fields: dict[str, None] = {}
    for path in paths:
        info, shard_fields = index_tar(fs, path, posixpath.basename(path))
        shards.append(info)
        fields.update(dict.fromkeys(shard_fields))
        log.info("indexed %s: %d samples", path, info.samples)
        if progress is not None:
            progress(1)
    manifest = Manifest(version=FORMAT_VERSION, format="tar", fields=list(fields), shards=shards)
    written = manifest.save(manifest_path, fs=fs)
    return {
        "samples": manifest.samples,
        "shards": len(shards),
        "bytes": manifest.bytes,
        "fields": manifest.fields,
        "manifest": written,
    }
