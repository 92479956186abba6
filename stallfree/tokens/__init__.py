"""Token data for language models, read where users already keep it: Megatron-LM / NeMo indexed
datasets (``.bin`` + ``.idx``), nanoGPT-style raw ``.bin`` files, Arrow / Parquet list-of-int
columns (Hugging Face ``datasets.map(tokenize)``); fixed-length packed windows over them
(``TokenDataset``); and ``tokenize_files`` to write token shards from text. May import
``stallfree.shards``; nothing else of ours."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TokenDataset": "stallfree.tokens.packing",
    "open_tokens": "stallfree.tokens.packing",
    "MegatronSource": "stallfree.tokens.megatron",
    "MegatronWriter": "stallfree.tokens.megatron",
    "RawBinSource": "stallfree.tokens.rawbin",
    "ArrowTokenSource": "stallfree.tokens.arrow_tokens",
    "tokenize_files": "stallfree.tokens.tokenize",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stallfree.tokens' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
