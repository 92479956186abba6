"""How a failed bench is reported: the rank that failed, and one line for its error."""

from __future__ import annotations

import re


class RankFailed(RuntimeError):
    """A spawned rank raised or died; the message names the rank and its error line."""


_QUALIFIED = re.compile(r"^[\w.]+: ")


def error_line(exc: BaseException) -> str:
    """One line for ``exc``: its message, or, when the message carries a traceback (a loader
    re-raising a worker's error, as torch does: "Caught X in DataLoader worker ... Original
    Traceback ..."), that traceback's last line, the worker's own error, without the
    ``module.Type: `` prefix when it repeats ``exc``'s type."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if len(lines) == 1:
        return lines[0]
    last = lines[-1]
    prefix = _QUALIFIED.match(last)
    if prefix and prefix.group(0)[:-2].rpartition(".")[2] == type(exc).__name__:
        return last[prefix.end() :]
    return last
