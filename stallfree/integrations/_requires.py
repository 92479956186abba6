"""Import an optional framework, or fail with one line that says what to install."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(package: str, *, needed_by: str, pip: str) -> ModuleType:
    """``import package``; if it is not installed, an ImportError naming ``needed_by`` and the
    ``pip install`` line (an ImportError from inside an installed package is left as it is: that
    is a broken install, not a missing one)."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name != package:
            raise
        raise ImportError(
            f"{needed_by} needs {package}, which is not installed: pip install '{pip}'"
        ) from None
