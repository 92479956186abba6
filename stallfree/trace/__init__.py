"""Provenance of training batches: the samples of any step (``samples_at``, ``stallfree trace``;
computed in the loader's epoch wing, ``loader/epoch/samples.py``, and re-exported here) and the
audit of a delivery record (``record_keys=``, ``stallfree audit``). Above the loader: it imports
``stallfree.loader``'s epoch wing, and the loader never imports it."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "StepSamples": "stallfree.loader.epoch.samples",
    "SampleRef": "stallfree.loader.epoch.refs",
    "DocumentSpan": "stallfree.loader.epoch.refs",
    "trace_state": "stallfree.loader.epoch.samples",
    "audit": "stallfree.trace.audit",
    "AuditReport": "stallfree.trace.audit",
    "Violation": "stallfree.trace.audit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stallfree.trace' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
