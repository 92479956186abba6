"""How a failed bench is reported."""

from __future__ import annotations


class RankFailed(RuntimeError):
    """A spawned rank raised or died; the message names the rank and its error line."""
