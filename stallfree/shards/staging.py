"""Local staging moved to :mod:`stallfree.storage.staging` (bytes at a URL, not a shard format).

Importing a name from here still works, with a :class:`DeprecationWarning` naming the new place."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from stallfree.storage import staging

    value = getattr(staging, name)  # AttributeError for a name that never existed
    warnings.warn(
        f"stallfree.shards.staging.{name} moved to stallfree.storage.staging.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
