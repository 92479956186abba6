"""Weighted mixtures of datasets with their own, already interleaved order (``mix``).

This package is callable: ``stallfree.mix(...)`` is ``stallfree.mix.mixture.mix(...)``. Why:
``stallfree.mix`` names both the public function and this package, and Python's import system
binds the package to that attribute whenever a submodule is imported first; a callable package
makes either binding work. Its attribute ``mix`` is the package itself, not the function:
``stallfree``'s lazy export reads ``stallfree.mix.mix``, and the function there would hide
``stallfree.mix.collate_by_source`` (the README's line) behind a plain function.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "mix": "stallfree.mix.mixture",
    "Mixture": "stallfree.mix.mixture",
    "MixtureMismatch": "stallfree.mix.mixture",
    "Ordered": "stallfree.mix.mixture",
    "collate_by_source": "stallfree.mix.mixture",
    "quotas": "stallfree.mix.schedule",
    "interleave": "stallfree.mix.schedule",
    "Schedule": "stallfree.mix.weights",
    "stages": "stallfree.mix.weights",
    "linear": "stallfree.mix.weights",
    "cosine": "stallfree.mix.weights",
    "from_function": "stallfree.mix.weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "mix":
        return sys.modules[__name__]  # callable: see the module docstring
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stallfree.mix' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``stallfree.mix.mixture.mix``: see its docstring."""
        return importlib.import_module("stallfree.mix.mixture").mix(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
