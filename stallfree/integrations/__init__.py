"""Hugging Face training frameworks with ``stallfree.DataLoader`` as their train loader.

- ``stallfree.integrations.transformers``: ``Trainer``, transformers' ``Trainer`` whose train
  loader is ours, with its state in every checkpoint and an exact mid-epoch resume.
- ``stallfree.integrations.accelerate``: ``Accelerator``, whose ``prepare`` hands our loader back
  as it is and whose ``save_state`` / ``load_state`` carry its state.

Both frameworks are optional: importing this package imports neither (nor torch); a submodule
imported without its framework installed raises one ImportError line saying what to install.
The loader's state goes into checkpoints as JSON (``state_file.py``), never pickle.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_SUBMODULES = ("transformers", "accelerate", "state_file")

__all__ = list(_SUBMODULES)


def __getattr__(name: str) -> ModuleType:
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'stallfree.integrations' has no attribute {name!r}")
    return importlib.import_module(f"stallfree.integrations.{name}")


def __dir__() -> list[str]:
    return __all__
