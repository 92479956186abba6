"""Running out of file descriptors (EMFILE) turned into an error that says what to do.

Why: under torch's ``file_descriptor`` sharing strategy every shared-memory segment a process
maps holds one descriptor for as long as it is mapped. A batch the consumer keeps (``list(loader)``,
a cache of batches) keeps its slot's segment, so at ``ulimit -n 1024`` about a thousand kept
batches exhaust the main process, and the failure surfaced as torch's "could not duplicate a
shared memory file descriptor", a segment socket "closed before segment N (the worker died?)",
or a bare ``OSError: [Errno 24]`` at the next ``iter()``: none of them names the cause or the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os

from stallfree.loader.errors import TooManyOpenFilesError

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]


def out_of_descriptors() -> bool:
    """Whether this process cannot open one more file now (EMFILE)."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
    except OSError as exc:
        return exc.errno in (errno.EMFILE, errno.ENFILE)
    os.close(fd)
    return False


def is_emfile(exc: BaseException) -> bool:
    """An OSError that is "too many open files" (this process's limit, or the system's)."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def limits() -> tuple[int, int] | None:
    """(soft, hard) RLIMIT_NOFILE, or None where there is no such limit to read."""
    if resource is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return int(soft), int(hard)
    return None


def too_many_open_files(where: str) -> TooManyOpenFilesError:
    """The error to raise (``from`` the original) when ``where`` failed for want of descriptors."""
    lim = limits()
    if lim is None:
        now, raise_to = "", "ulimit -n 65536"
    else:
        soft, hard = lim  # read through ``resource``, so it is there
        unlimited = hard == resource.RLIM_INFINITY
        now = f" (ulimit -n is {soft}, the hard limit {'unlimited' if unlimited else hard})"
        target = 65536 if unlimited else min(max(hard, soft), 1 << 20)
        raise_to = f"ulimit -n {target}"
    return TooManyOpenFilesError(
        f"too many open files{now} while {where}: every batch kept alive holds one shared-memory file "
        "descriptor until its last tensor is dropped, so keeping many batches (list(loader), a "
        "buffer of batches) runs out of them. Raise the limit before starting the job "
        f"(`{raise_to}` in the shell, or resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)) in the "
        "script before building the loader), or keep fewer batches: copy what you keep "
        "(tensor.clone()) so the batch itself is released"
    )
