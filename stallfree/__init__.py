"""stallfree: an input-pipeline accelerator for PyTorch training.

The public API, re-exported lazily so that ``import stallfree`` stays cheap (torch, pyarrow and
DALI load only when the names that need them are first used).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "open_dataset": "stallfree.shards.open",
    "ShardWriter": "stallfree.shards.writer",
    "DataLoader": "stallfree.loader.dataloader",
    "RayWorkers": "stallfree.engines.ray_workers",
    "get_worker_info": "stallfree.loader.worker.main",
    "MemoryCache": "stallfree.cache.memory",
    "NodeCache": "stallfree.cache.node",
    "ClusterCache": "stallfree.cache.cluster",
    "TieredCache": "stallfree.cache.tiered",
    "ImageDecode": "stallfree.gpu_decode.select",
    "normalize": "stallfree.gpu_decode.normalize",
    "mix": "stallfree.mix",
    "TokenDataset": "stallfree.tokens.packing",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stallfree' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
