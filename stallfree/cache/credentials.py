"""Password and secret files for the cluster cache: created private (0600), read back strictly.

A password on a command line is visible to every local user (``ps``), and an unauthenticated
loopback server is writable by every local process, so ``stallfree cache serve`` makes a random
password by default and hands it over in a file; clients name the file, never the value.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

log = logging.getLogger(__name__)

_MAX_BYTES = 4096  # a password or secret file is one short line


class CredentialFileError(ValueError):
    """A password or secret file that cannot be used (missing, empty, too long, not a file)."""


def read_secret_file(path: str | os.PathLike, what: str = "password") -> str:
    """The first line of ``path`` (surrounding whitespace stripped); ``CredentialFileError`` if
    unusable. A file other users may read is used, with a warning."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            raise CredentialFileError(f"{what} file {p} is not a regular file")
        if st.st_size > _MAX_BYTES:
            raise CredentialFileError(f"{what} file {p} is {st.st_size} bytes; expected one short line")
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialFileError(f"cannot read {what} file {p}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise CredentialFileError(f"{what} file {p} is not UTF-8 text") from exc
    value = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not value:
        raise CredentialFileError(f"{what} file {p} is empty")
    if st.st_mode & 0o077:
        log.warning(
            "%s file %s is readable by other users (mode %o); chmod 600 it", what, p, st.st_mode & 0o777
        )
    return value


def ensure_secret_file(path: str | os.PathLike, what: str = "password") -> tuple[str, bool]:
    """``(value, created)``: the value in ``path``, or a new random one written there (0600, never
    over an existing file), so every node pointed at one shared file agrees on it."""
    p = Path(path)
    if p.exists():
        return read_secret_file(p, what), False
    value = secrets.token_urlsafe(32)  # 256 bits; [A-Za-z0-9_-], safe in redis.conf and URLs
    try:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another node created it first: use theirs
        return read_secret_file(p, what), False
    except OSError as exc:
        raise CredentialFileError(f"cannot create {what} file {p}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    return value, True
