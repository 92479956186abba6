"""Provenance of training batches: the samples of any step (``samples_at``, ``stallfree trace``)
computed from a resume state and the dataset, and the audit of a delivery record
(``record_keys=``, ``stallfree audit``). Above the loader: it imports ``stallfree.loader``'s
epoch wing; the loader reaches it only from ``DataLoader.samples_at``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "StepSamples": "stallfree.trace.steps",
    "SampleRef": "stallfree.trace.refs",
    "DocumentSpan": "stallfree.trace.refs",
    "trace_state": "stallfree.trace.steps",
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
