"""The staging area's directories, checked before use (issue 36 item 1): the default root,
``stallfree-staging-<uid>`` in the temp directory, is a name anyone can guess, so the root and
every namespace directory are opened with ``O_NOFOLLOW | O_DIRECTORY`` and checked through the
descriptor (``lstat`` before, ``fstat`` after: the same directory, not a symbolic link, owned by
this user, writable by no one else). A failed check is a ``StagingDirError`` naming the path and
the problem. Everything inside is then done relative to these descriptors (``dir_fd``), so a
symlink swapped in later is never followed."""

from __future__ import annotations

import contextlib
import errno
import os
import stat

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StagingDirError(RuntimeError):
    """A staging directory that is not safe to use: not ours, writable by others, a symlink."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(
            f"staging directory {path} {problem}: refusing to stage there (another user could plant "
            "or read staged shards); remove it, or pass staging=Staging(root=...) naming a directory "
            "of your own"
        )

    def __reduce__(self):  # keep the fields across process boundaries (worker -> main)
        return (StagingDirError, (self.path, self.problem))


def open_private_dir(path: str, create: bool = False) -> int:
    """A descriptor of directory ``path`` (made 0700 when missing and ``create``), checked:
    not a symbolic link, owned by this user, writable by no one else (``StagingDirError``)."""
    if create:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    return open_checked_dir(path, path)


def open_checked_dir(name: str, path: str, dir_fd: int | None = None) -> int:
    """A descriptor of directory ``name`` (relative to ``dir_fd``; ``path`` is how errors name it),
    checked as ``open_private_dir``'s; a namespace made before copies were private is made 0700."""
    try:
        before = os.lstat(name, dir_fd=dir_fd) if dir_fd is not None else os.lstat(name)
    except FileNotFoundError:
        raise
    if stat.S_ISLNK(before.st_mode):
        raise StagingDirError(path, "is a symbolic link")
    if not stat.S_ISDIR(before.st_mode):
        raise StagingDirError(path, "is not a directory")
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StagingDirError(path, "was replaced by a symbolic link or a file") from exc
        raise
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise StagingDirError(path, "was replaced while it was opened")
        euid = os.geteuid()
        if st.st_uid != euid:
            raise StagingDirError(path, f"is owned by uid {st.st_uid}, not by this user (uid {euid})")
        if st.st_mode & 0o022:
            raise StagingDirError(
                path, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
            )
        if dir_fd is not None and st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # a namespace made before staged copies were private
    except BaseException:
        os.close(fd)
        raise
    return fd


__all__ = ["DIR_FLAGS", "StagingDirError", "open_checked_dir", "open_private_dir"]
