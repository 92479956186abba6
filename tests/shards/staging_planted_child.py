"""Child of ``test_staging_planted.py``: plant one thing (argv[2]) under a staging root
(argv[1]), then stage a file through it and print what happened as one JSON line. A child with a
timeout, because what is planted (a FIFO) could block an open for ever."""

from __future__ import annotations

import json
import os
import sys

from stallfree.storage import digests
from stallfree.storage.staging import NOTE_FILE, ROOM_FILE, Expected, StagingArea

DATA = bytes(range(256)) * 20


def plant(root: str, what: str) -> None:
    ns = os.path.join(root, "fp")
    os.makedirs(ns, mode=0o700)
    target = {
        "file": os.path.join(ns, "shard.tar"),
        "lock": os.path.join(ns, "shard.tar.lock"),
        "room": os.path.join(root, ROOM_FILE),
        "note": os.path.join(ns, NOTE_FILE),
    }[what.split("-", 1)[1]]
    kind = what.split("-", 1)[0]
    if kind == "fifo":
        os.mkfifo(target, 0o600)
    elif kind == "symlink":
        os.symlink(os.path.join(os.path.dirname(root), "outside"), target)
    elif kind == "dir":
        os.mkdir(target, 0o700)


def main(root: str, what: str) -> None:
    os.makedirs(root, mode=0o700)
    plant(root, what)
    area = StagingArea(root)
    out: dict = {"note": area.read_note("fp")}
    h = digests.fast_hasher()
    h.update(DATA)
    expect = Expected(len(DATA), "xxh3-128", h.hexdigest())
    try:
        with area.stage("fp", "shard.tar", lambda f: f.write(DATA), size=len(DATA), expect=expect) as s:
            out["same"] = open(s.path, "rb").read() == DATA
    except Exception as exc:  # noqa: BLE001 - the child reports every outcome
        out.update(type=type(exc).__name__, message=str(exc))
    out["outside"] = os.path.lexists(os.path.join(os.path.dirname(root), "outside"))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
