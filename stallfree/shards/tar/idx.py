"""DALI's text index for WebDataset tars (the format ``wds2idx`` writes and
``fn.readers.webdataset(index_paths=...)`` reads):

    v1.2 N
    FIELD OFFSET SIZE NAME [FIELD OFFSET SIZE NAME ...]     <- one line per sample

OFFSET is where the member's data starts (its header is the 512 bytes before), SIZE its length,
NAME the full member name ``KEY.FIELD``. Our reader uses the same file for random access.
"""

from __future__ import annotations

import posixpath
from typing import NamedTuple

from stallfree.errors import IndexMismatchError

IDX_VERSION = "v1.2"


class IdxSample(NamedTuple):
    """One sample: its key and members as ``(field, data_offset, size, member_name)``."""

    key: str
    members: list[tuple[str, int, int, str]]


def idx_path_for(tar_path: str) -> str:
    """``dir/shard-000001.tar`` -> ``dir/shard-000001.idx`` (DALI's and wds2idx's convention)."""
    head, tail = posixpath.split(tar_path)
    stem = tail[:-4] if tail.endswith(".tar") else tail
    return posixpath.join(head, stem + ".idx")


def shard_files(path: str) -> list[str]:
    """The files one shard consists of: a tar and its ``.idx``, or an Arrow file alone (what to
    remove, or check for, together)."""
    return [path, idx_path_for(path)] if path.endswith(".tar") else [path]


def render_idx(samples: list[IdxSample]) -> str:
    lines = [f"{IDX_VERSION} {len(samples)}"]
    for sample in samples:
        lines.append(" ".join(f"{f} {off} {size} {name}" for f, off, size, name in sample.members))
    return "\n".join(lines) + "\n"


def parse_idx(text: str | bytes, shard: str) -> list[IdxSample]:
    """Parse an index; IndexMismatchError (naming the shard and line) if it is malformed."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    if not text:
        raise IndexMismatchError("empty .idx file", shard=shard)
    lines = text.split("\n")  # as DALI reads it; the numbers in errors are then an editor's
    head = lines[0].split()
    if len(head) != 2 or head[0] != IDX_VERSION or not head[1].isdigit():
        raise IndexMismatchError(
            f".idx must start with '{IDX_VERSION} N', found {lines[0][:40]!r}", shard=shard
        )
    count = int(head[1])
    # blank lines are skipped, but errors name the line's real 1-based number in the file
    body = [(lineno, line) for lineno, line in enumerate(lines[1:], start=2) if line.strip()]
    if len(body) != count:
        raise IndexMismatchError(f".idx header says {count} samples but has {len(body)} lines", shard=shard)
    samples = []
    for lineno, line in body:
        tokens = line.split()
        if len(tokens) % 4:
            raise IndexMismatchError(
                f".idx line {lineno}: expected groups of 'FIELD OFFSET SIZE NAME'", shard=shard
            )
        members = []
        key = None
        for j in range(0, len(tokens), 4):
            field, off, size, name = tokens[j : j + 4]
            try:
                off_i, size_i = int(off), int(size)
            except ValueError:
                raise IndexMismatchError(
                    f".idx line {lineno}: bad offset/size {off!r} {size!r}", shard=shard
                ) from None
            if off_i < 512 or size_i < 0:
                raise IndexMismatchError(
                    f".idx line {lineno}: impossible offset/size", shard=shard, offset=off_i
                )
            member_key = name[: len(name) - len(field) - 1] if name.endswith("." + field) else None
            if member_key is None or (key is not None and member_key != key):
                raise IndexMismatchError(
                    f".idx line {lineno}: member {name!r} does not belong to the sample",
                    shard=shard,
                    offset=off_i,
                )
            key = member_key
            members.append((field, off_i, size_i, name))
        samples.append(IdxSample(key, members))
    return samples
