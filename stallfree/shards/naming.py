"""What may name a sample and a field, in every format: the rules a writer checks before it
writes anything (``WriteError`` naming the key).

Why a module of its own: the rules are the dataset's, not tar's. A key becomes a tar member's
name (``KEY.FIELD``), an Arrow ``__key__`` value and a path when a shard is unpacked; a field
becomes a member suffix or a column. The Arrow writer used to borrow them from the tar writer,
so one format imported the other; a new format checks names here instead.
"""

from __future__ import annotations

from typing import Any

from stallfree.errors import WriteError


def check_key(key: Any) -> str:
    """Keys name samples: no dot in the last path part (the first dot starts the field), no spaces,
    and nothing that would escape a folder the shard is unpacked into (absolute, ``..``)."""
    if not isinstance(key, str) or not key:
        raise WriteError(f"sample '__key__' must be a non-empty string, got {key!r}")
    base = key.rsplit("/", 1)[-1]
    if (
        not base
        or "." in base
        or any(c.isspace() for c in key)
        or "\0" in key
        or key.startswith("/")
        or ".." in key.split("/")
    ):
        raise WriteError(
            f"invalid sample key {key!r}: no '.' after the last '/', no whitespace, not absolute, no '..' part",
            key=key,
        )
    return key


def check_field(field: Any, key: str) -> str:
    """Field names: non-empty, no ``/`` (a member name's path is the key's) and no whitespace."""
    if not isinstance(field, str) or not field or "/" in field or any(c.isspace() for c in field):
        raise WriteError(f"invalid field name {field!r}: non-empty, no '/' and no whitespace", key=key)
    return field


__all__ = ["check_field", "check_key"]
