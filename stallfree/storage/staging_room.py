"""The staging area's cap (issue 36 item 8: pinned copies were never evicted; a 4 MB cap peaked at
9.5 MB and left 8 MB behind). Room for a whole file is reserved under an exclusive ``flock`` on
``<root>/.room``, which keeps the node's running total (``Ledger``), before the file is created;
the area is recounted now and then (``RECOUNT_EVERY``) and whenever the total says there is no
room. No room while the files in use are pinned is ``StagingFullError``: the reader then reads
that shard with ranged GETs (``staged_reads.py``) rather than wait with pins of its own."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

ROOM_FILE = ".room"  # the root's running total and the lock every change of it is made under
MAX_DEFAULT_CAP = 256 << 30
RECOUNT_EVERY = 64  # files staged on the node between two walks of the whole area


class StagingFullError(RuntimeError):
    """No room for a file under the cap: the files that would have to go are in use (pinned),
    or the file alone is larger than the cap."""

    def __init__(self, path: str, size: int, cap: int, reason: str) -> None:
        self.path, self.size, self.cap, self.reason = path, size, cap, reason
        super().__init__(f"no room to stage {path} ({size} bytes) under the cap of {cap} bytes: {reason}")

    def __reduce__(self):
        return (StagingFullError, (self.path, self.size, self.cap, self.reason))


@dataclass
class Ledger:
    """The ``.room`` file's content: bytes staged on the node (None: unknown, count them) and
    files staged since the last count."""

    total: int | None
    since_walk: int

    @classmethod
    def read(cls, fd: int) -> Ledger:
        raw = os.pread(fd, 64, 0).split()
        try:
            total, since = int(raw[0]), int(raw[1])
        except (IndexError, ValueError):
            return cls(None, 0)
        return cls(total if total >= 0 else None, since)

    def write(self, fd: int) -> None:
        body = f"{-1 if self.total is None else self.total} {self.since_walk}\n".encode()
        os.pwrite(fd, body.ljust(48), 0)


def default_cap(root: str) -> int:
    """Half the space free on ``root``'s file system, at most ``MAX_DEFAULT_CAP``."""
    return max(1, min(MAX_DEFAULT_CAP, shutil.disk_usage(root).free // 2))


__all__ = ["MAX_DEFAULT_CAP", "RECOUNT_EVERY", "ROOM_FILE", "Ledger", "StagingFullError", "default_cap"]
