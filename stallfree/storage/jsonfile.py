"""JSON read from a dataset's files (MDS and LitData ``index.json``, Hugging Face ``state.json``,
``dataset_info.json``, ``dataset_dict.json``), parsed with a typed error that names the file.

Why: these files come from elsewhere. ``json.loads`` raises ``RecursionError`` for an array
nested a few thousand deep, ``UnicodeDecodeError`` for bytes that are not UTF-8, and a bare
``JSONDecodeError`` naming no file; callers then leaked those to users. Here every one of them is
a ``JSONFileError`` (a ``CorruptShardError`` and a ``ValueError``, so callers that already catch
``ValueError`` keep working) whose message and ``shard`` name the file. A size cap keeps a huge
file from being read whole into memory by mistake.
"""

from __future__ import annotations

import json
from typing import Any

from stallfree.errors import CorruptShardError

# An index of a million-shard MDS dataset is ~500 MB; anything larger is not an index.
MAX_JSON_BYTES = 1 << 30


class JSONFileError(CorruptShardError, ValueError):
    """A dataset's JSON file is not valid JSON (or nested too deep, or too large); ``shard``
    names the file."""


def parse_json(data: bytes | str, where: str, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``data`` (the bytes or text of file ``where``) parsed as JSON; ``JSONFileError`` naming
    ``where`` for anything that is not JSON a dataset could mean."""
    if len(data) > max_bytes:
        raise JSONFileError(
            f"{len(data)} bytes, more than the {max_bytes} a JSON index may take", shard=where
        )
    try:
        return json.loads(data)
    except RecursionError:
        raise JSONFileError("not valid JSON: nested too deeply to parse", shard=where) from None
    except UnicodeDecodeError as exc:
        raise JSONFileError(
            f"not valid JSON: not UTF-8 text ({exc.reason} at byte {exc.start})",
            shard=where,
            offset=exc.start,
        ) from None
    except ValueError as exc:  # json.JSONDecodeError; or a plain ValueError: an integer of more
        # digits than int() converts (4300: sys.set_int_max_str_digits), which has no .msg
        raise JSONFileError(
            f"not valid JSON: {getattr(exc, 'msg', exc)}", shard=where, offset=getattr(exc, "pos", None)
        ) from None


def read_json(path: str, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The local JSON file ``path``, parsed; ``JSONFileError`` for bad JSON, ``OSError`` when it
    cannot be read (the caller says what a missing file means)."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    return parse_json(data, path, max_bytes=max_bytes)


__all__ = ["MAX_JSON_BYTES", "JSONFileError", "parse_json", "read_json"]
