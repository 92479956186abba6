"""Whether a copy found staged may be used as it is (issue 36 item 2: a copy kept from an earlier
run was trusted by its size alone, so 64 bytes flipped were one wrong sample, no error).

A copy must be a regular file of this user, the manifest's size, and have the manifest's digest.
The digest is taken once per node and copy: it is recorded on the file (``MARK``, an extended
attribute with the file's inode, size and mtime, which any write changes), so a later process
compares that record instead of hashing again; a file system without extended attributes hashes
once per process. This guards against damage, not against someone who can write the user's
files (they can write the record too): the directory checks (``staging_dirs.py``) keep others out.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass

from stallfree.storage import digests

MARK = "user.stallfree.verified"  # the extended attribute recording a checked copy
NO_XATTR = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.ENOSPC, errno.E2BIG}
if hasattr(errno, "ENODATA"):
    NO_XATTR.add(errno.ENODATA)
OK, UNCHECKED, ABSENT = "ok", "unchecked", "absent"  # what ``judge`` (and ``StagingArea._pin``) say


@dataclass(frozen=True)
class Expected:
    """What a staged file must be: ``size`` bytes (None: any) with digest ``digest`` under
    ``algorithm`` (``"xxh3-128"`` or ``"sha256"``; None: no digest known)."""

    size: int | None = None
    algorithm: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        if (self.algorithm is None) != (self.digest is None):
            raise ValueError("Expected: algorithm and digest go together")
        if self.algorithm not in (None, "xxh3-128", "sha256"):
            raise ValueError(f"Expected: unknown digest algorithm {self.algorithm!r}")

    def hasher(self):  # noqa: ANN201 - an xxhash or hashlib state
        return digests.fast_hasher() if self.algorithm == "xxh3-128" else hashlib.sha256()


def judge(fd: int, st: os.stat_result, expect: Expected, checked: dict) -> str:
    """What a look (no hashing) says of an open staged copy: ``OK`` (known good), ``UNCHECKED``
    (its digest must be taken), or what is wrong with it. ``checked``: the copies this process
    checked or fetched, ``(st_dev, st_ino, st_size, st_mtime_ns) -> digest``."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if expect.size is not None and st.st_size != expect.size:
        return f"{st.st_size} bytes, the manifest records {expect.size}"
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if identity in checked and checked[identity] == expect.digest:
        return OK
    mark = read_mark(fd)
    if mark is not None:
        ino, size, mtime_ns, algorithm, digest = mark
        if (ino, size, mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
            return "written to after it was staged"
        if expect.digest is None or (algorithm, digest) == (expect.algorithm, expect.digest):
            checked[identity] = expect.digest
            return OK
    if expect.digest is None:
        # a sidecar with neither a digest nor the record of its fetch (staged before marks were,
        # its mark lost, a file system without xattrs): nothing vouches for it, and a damaged
        # one (cut short) failed every later run, so it is fetched again (it is small)
        return "no record of its fetch, and no digest to check it against"
    return UNCHECKED


def record(fd: int, st: os.stat_result, expect: Expected, checked: dict) -> None:
    """Note a checked copy (this process's memory, and the file's mark for the node's others)."""
    checked[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)] = expect.digest
    value = f"{st.st_ino} {st.st_size} {st.st_mtime_ns} {expect.algorithm or '-'} {expect.digest or '-'}"
    try:
        os.setxattr(fd, MARK, value.encode())
    except OSError as exc:
        if exc.errno not in NO_XATTR:
            raise


def read_mark(fd: int) -> tuple[int, int, int, str | None, str | None] | None:
    try:
        raw = os.getxattr(fd, MARK)
    except OSError as exc:
        if exc.errno in NO_XATTR:
            return None
        raise
    parts = raw.decode("ascii", "replace").split()
    if len(parts) != 5:
        return None
    try:
        ino, size, mtime_ns = int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        return None
    algorithm, digest = (None if p == "-" else p for p in parts[3:])
    return ino, size, mtime_ns, algorithm, digest


__all__ = ["ABSENT", "MARK", "NO_XATTR", "OK", "UNCHECKED", "Expected", "judge", "read_mark", "record"]
