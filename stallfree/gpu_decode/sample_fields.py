"""What ``ImageDecode`` does with a sample's fields besides the image: which field is the label,
reading it, and carrying every other field into the decoded batch.

Label field resolution: ``label_field="name"`` as given; ``None`` (the default) the dataset's
manifest's ``class_field`` (``stallfree shard`` records it for Hugging Face ``ClassLabel``
columns, e.g. ``label``), else ``cls`` (WebDataset / ImageFolder); ``False`` no labels. A sample
without the field is an error naming its key and the fields it has, never a label of -1 found
only when ``cross_entropy`` raises.

Pass-through: every field that is not the decoded image or the label comes through under its own
name, collated: a tensor where every sample holds a number or a same-shaped numeric array
(``default_collate``'s dtypes: int64, float64, or the arrays' own), a list of ``bytes`` or ``str``
(byte-equal), else a list of the values as they are (``None`` where a sample lacks the field).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stallfree.shards.arrow.hf import columns_from_features

log = logging.getLogger(__name__)

DEFAULT_LABEL_FIELD = "cls"
LABEL_NAMES = ("label", "labels", "cls", "class", "target", "targets", "y")  # named in the error's hint
OUTPUT_FIELDS = ("image", "label", "__key__")
_INT64_MAX = int(np.iinfo(np.int64).max)


def check_label_field(label_field: Any) -> None:
    """ValueError unless ``label_field`` is a field name, None (resolve) or False (no labels)."""
    if label_field is None or label_field is False:
        return
    if not isinstance(label_field, str) or not label_field:
        raise ValueError(
            f"label_field must be a field name, None (the manifest's class_field, else {DEFAULT_LABEL_FIELD!r}) "
            f"or False (no labels), got {label_field!r}"
        )


def class_field_of(dataset: Any) -> str | None:
    """The ``class_field`` a dataset's manifest records (``open_dataset``'s ``ShardedDataset``,
    also inside a torch ``Subset``), or, for a Hugging Face ``datasets.Dataset`` handed to the
    loader as it is, its ``ClassLabel`` column as ``stallfree shard`` would record it; None when
    neither says."""
    for _ in range(4):  # Subset(Subset(ds)) and the like
        extra = getattr(getattr(dataset, "manifest", None), "extra", None)
        if isinstance(extra, dict):
            field = extra.get("class_field")
            return field if isinstance(field, str) and field else None
        hf_field = _hf_class_field(dataset)
        if hf_field is not None:
            return hf_field
        dataset = getattr(dataset, "dataset", None)
        if dataset is None:
            break
    return None


def _hf_class_field(dataset: Any) -> str | None:
    """A ``datasets.Dataset``'s ClassLabel column (``label`` first), from its ``features``
    serialised as the library writes them; None for anything else."""
    to_dict = getattr(getattr(dataset, "features", None), "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        features = to_dict()
    except Exception:  # noqa: BLE001 - not a datasets.Features after all
        return None
    return columns_from_features(features).class_field if isinstance(features, dict) else None


def read_label(sample: dict, field: str, *, from_manifest: bool) -> int:
    """The integer label in ``sample[field]`` (int, integral float, numpy integer, or ASCII
    digits as bytes/str). KeyError naming the sample's fields when it has none (the caller's
    ``SampleDecodeError`` adds the key); ValueError when it is not an integer."""
    value = sample.get(field)
    if value is None:
        raise KeyError(_missing(sample, field, from_manifest))
    try:
        if isinstance(value, (bytes, bytearray, memoryview)):
            value = bytes(value).decode("ascii").strip()
        if isinstance(value, (float, np.floating)) and not float(value).is_integer():
            raise ValueError
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        return int(value)
    except (ValueError, TypeError, UnicodeDecodeError, OverflowError):
        raise ValueError(f"label field {field!r} is not an integer: {value!r:.40}") from None


def _missing(sample: dict, field: str, from_manifest: bool) -> str:
    fields = [f for f in sample if f != "__key__"]
    why = "the dataset's manifest names it as class_field" if from_manifest else "label_field"
    if not from_manifest and field == DEFAULT_LABEL_FIELD:
        why = "the default where no bound dataset's manifest names a class_field"
    hint = next((f for f in LABEL_NAMES if f in sample and f != field), None)
    fix = f"pass label_field={hint!r}, or" if hint is not None else "pass label_field=<its label field>, or"
    return (
        f"no label field {field!r} ({why}); the sample's fields are {fields}: "
        f"{fix} label_field=False to decode without labels"
    )


_warned_collisions: set[str] = set()


def passthrough(
    samples: Sequence[dict], consumed: set[str], produced: Sequence[str], device: torch.device
) -> dict[str, Any]:
    """Every field of ``samples`` not in ``consumed`` (nor ``__key__``), collated field by field
    in the order the fields first appear. Numeric tensors go to ``device`` (the labels' device).
    A field named like one the decoder ``produced`` (``image``, ``label``) cannot pass under its
    name: it is left out, with one WARNING per process naming it."""
    names: dict[str, None] = {}
    for sample in samples:
        for name in sample:
            if name in consumed or name == "__key__":
                continue
            if name in produced:
                if name not in _warned_collisions:
                    _warned_collisions.add(name)
                    log.warning(
                        "samples have a field %r besides the decoded one: left out of the decoded batch, "
                        "whose %r is the decoder's (name it in image_field= / label_field= to use it)",
                        name,
                        name,
                    )
                continue
            names.setdefault(name, None)
    out: dict[str, Any] = {}
    for name in names:
        value = collate_values([s.get(name) for s in samples])
        if isinstance(value, torch.Tensor) and device.type != "cpu":
            value = value.to(device, non_blocking=True)
        out[name] = value
    return out


def collate_values(values: list[Any]) -> Any:
    """One field's values across a batch: a tensor where they are all numbers or same-shaped
    numeric arrays/tensors, ``bytes`` or ``str`` as a list, anything else as the list it is."""
    if not values or any(v is None for v in values):
        return values
    if all(isinstance(v, (bytes, bytearray, memoryview)) for v in values):
        return [bytes(v) for v in values]
    if all(isinstance(v, str) for v in values):
        return values
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(values) if len({tuple(v.shape) for v in values}) == 1 else values
    if all(_is_number(v) for v in values) or all(isinstance(v, np.ndarray) for v in values):
        arr = _stack(values)
        return torch.from_numpy(arr) if arr is not None else values
    return values


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number, np.bool_)) and not isinstance(value, complex)


def _stack(values: list[Any]) -> np.ndarray | None:
    """The values as one numeric array (None: ragged, non-numeric, or unsigned ids beyond int64,
    which torch cannot hold)."""
    if len({np.shape(v) for v in values}) != 1:
        return None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if any(not -_INT64_MAX - 1 <= v <= _INT64_MAX for v in values):
            return None  # numpy would make them float64, silently rounding ids
        return np.asarray(values, np.int64)
    arr = np.stack([np.asarray(v) for v in values])
    if arr.dtype.kind not in "biuf":
        return None
    if arr.dtype.kind == "u" and arr.dtype.itemsize > 1:  # torch's uint16/32/64 support little
        if arr.size and int(arr.max()) > _INT64_MAX:
            return None
        arr = arr.astype(np.int64)
    return np.ascontiguousarray(arr)


__all__ = [
    "DEFAULT_LABEL_FIELD",
    "OUTPUT_FIELDS",
    "check_label_field",
    "class_field_of",
    "collate_values",
    "passthrough",
    "read_label",
]
