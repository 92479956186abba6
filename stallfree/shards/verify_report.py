"""What a verify run reports (``verify.py``; each shard format's ``verify``, ``formats.py``):
the problems found, as errors and as plain records, and the counts. Its own module so that the
format protocol can name it without importing the verifier that dispatches on formats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stallfree.errors import ShardError

ProgressFn = Callable[[int], None]  # bytes checked
KeyAt = tuple[str, int | None]  # a sample key and the byte offset of its first header (tar)


@dataclass
class Problem:
    """One thing wrong, as reported: the error class name, where, and a message."""

    error: str
    message: str
    shard: str | None = None
    key: str | None = None
    offset: int | None = None

    @classmethod
    def from_error(cls, exc: ShardError) -> Problem:
        return cls(type(exc).__name__, exc.reason, exc.shard, exc.key, exc.offset)

    def to_json(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "shard": self.shard,
            "key": self.key,
            "offset": self.offset,
            "message": self.message,
        }


@dataclass
class VerifyReport:
    """What a verify run found: counts, and ``errors`` (the ShardErrors, in the order found);
    ``problems`` is the same list as plain records for printing and JSON."""

    dataset: str
    format: str | None = None
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    decoded: int = 0
    errors: list[ShardError] = field(default_factory=list)

    @property
    def problems(self) -> list[Problem]:
        return [Problem.from_error(e) for e in self.errors]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "ok": self.ok,
            "format": self.format,
            "shards": self.shards,
            "samples": self.samples,
            "bytes": self.bytes,
            "decoded": self.decoded,
            "problems": [p.to_json() for p in self.problems],
        }


__all__ = ["KeyAt", "Problem", "ProgressFn", "VerifyReport"]
