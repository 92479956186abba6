"""``stallfree index``: give existing WebDataset tars a DALI ``.idx`` each and a ``manifest.json``
(with sha256), built with ``scan.manifest_for_tars`` (the tar headers, never an old ``.idx``).

A thin layer over ``scan``: it takes several paths (what a shell glob expands to), refuses to
replace an existing manifest unless asked, and reports progress per shard.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Sequence
from typing import Any

import fsspec

from stallfree.errors import DatasetExistsError, MissingShardError
from stallfree.shards.manifest.model import MANIFEST_NAME
from stallfree.shards.scan import manifest_for_tars, resolve, resolve_files
from stallfree.shards.tar.idx import idx_path_for, render_idx
from stallfree.storage.atomic import atomic_write_bytes


def _tar_paths(
    tars: Sequence[str], **storage_options: Any
) -> tuple[fsspec.AbstractFileSystem, str, list[str]]:
    if len(tars) == 1:
        fs, root, paths = resolve(tars[0], **storage_options)
        if paths is None:  # a directory that already has a manifest: index the tars in it
            paths = sorted(p for p in fs.ls(root, detail=False) if p.endswith(".tar"))
    else:
        fs, root, paths = resolve_files(tars, **storage_options)
    paths = list(dict.fromkeys(p for p in paths if p.endswith(".tar")))
    if not paths:
        raise MissingShardError(f"no .tar shards in {', '.join(tars)}", shard=tars[0])
    for p in paths:
        if not fs.exists(p):
            raise MissingShardError(f"tar {p} does not exist", shard=posixpath.basename(p))
    return fs, root, paths


def index_tars(
    tars: Sequence[str],
    *,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    **storage_options: Any,
) -> dict[str, Any]:
    """Index tars (files, a glob, a brace pattern or a directory); write ``manifest.json`` in their
    common directory. Returns a summary dict."""
    if not tars:
        raise ValueError("no tar files given")
    fs, root, paths = _tar_paths(tars, **storage_options)
    manifest_path = posixpath.join(root, MANIFEST_NAME)
    if fs.exists(manifest_path) and not overwrite:
        raise DatasetExistsError(f"{manifest_path} already exists")
    manifest, indices = manifest_for_tars(
        fs,
        root,
        paths,
        hashes=True,
        use_idx=False,
        progress=(lambda rel, size: progress(1)) if progress else None,
    )
    for path, samples in zip(paths, indices, strict=True):
        atomic_write_bytes(fs, idx_path_for(path), render_idx(samples).encode())
    written = manifest.save(manifest_path, fs=fs)
    return {
        "samples": manifest.samples,
        "shards": len(manifest.shards),
        "bytes": manifest.bytes,
        "fields": manifest.fields,
        "manifest": written,
    }
