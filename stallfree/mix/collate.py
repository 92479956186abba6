"""Batching a mixture whose sources' samples differ (images and tokens), and decoding per source.

torch's ``default_collate`` builds a dict batch from the first sample's fields, so a batch of
an image sample then a token sample dies on a bare ``KeyError: '__key__'``. Two ways out:

- ``collate_by_source``: ``{"__source__": [name per sample], name: that source's samples batched,
  ...}`` (only the sources present in the batch have a key): each source's samples collated on
  their own, or decoded by that source's decoder (``mix(..., decode={"images": ImageDecode(...)})``):
  a batch decoder (``decode_batch``) gets the source's samples as one batch, a per-sample callable
  maps each one before collation. Sources without a decoder are collated as they are.
- ``collate_mixed`` (what the loader uses for a mixture when no ``collate_fn`` is given):
  ``default_collate`` when the batch's samples share their fields, and otherwise a ``TypeError``
  naming each source's fields and the two ways out, instead of the ``KeyError``.

Decoders run wherever collation runs: in the loader's worker processes when it has workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def _default_collate(samples: Sequence[Any]) -> Any:
    from torch.utils.data import default_collate

    return default_collate(samples)


def _groups(batch: Sequence[Any]) -> tuple[list[str], dict[str, list[Any]]]:
    names: list[str] = []
    groups: dict[str, list[Any]] = {}
    for sample in batch:
        if not isinstance(sample, Mapping) or "__source__" not in sample:
            raise TypeError(
                f"collate_by_source needs dict samples tagged with '__source__' (a mixture's); got {type(sample).__name__}"
            )
        name = str(sample["__source__"])
        names.append(name)
        groups.setdefault(name, []).append(sample)
    return names, groups


def source_seed(seed: int, epoch: int, name: str) -> int:
    """The seed a source's batch decoder gets: fixed per (mixture seed, epoch, source), so random
    augmentation differs between epochs and is reproducible (decoders vary it per sample key)."""
    import zlib

    return int(
        np.random.SeedSequence([seed & (2**63 - 1), epoch, zlib.crc32(name.encode())]).generate_state(1)[0]
    )


def collate_by_source(
    batch: Sequence[Any],
    decode: Mapping[str, Any] | None = None,
    *,
    seed: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """Batch each source's samples on its own (see the module docstring); ``seed(name)`` gives a
    batch decoder its seed (default 0)."""
    names, groups = _groups(batch)
    out: dict[str, Any] = {"__source__": names}
    for name, samples in groups.items():
        dec = (decode or {}).get(name)
        if dec is None:
            out[name] = _default_collate(samples)
        elif hasattr(dec, "decode_batch"):
            out[name] = dec.decode_batch(samples, seed=seed(name) if seed is not None else 0)
        else:
            out[name] = _default_collate([dec(s) for s in samples])
    return out


def collate_mixed(batch: Sequence[Any]) -> Any:
    """``default_collate`` for a batch whose samples share their fields; a clear error otherwise."""
    fields: dict[str, tuple[str, ...]] = {}
    for sample in batch:
        if isinstance(sample, Mapping):
            keys = tuple(sorted(str(k) for k in sample if k != "__source__"))
            fields.setdefault(str(sample.get("__source__", "?")), keys)
    if len(set(fields.values())) > 1:
        detail = "; ".join(f"{name} has {', '.join(keys)}" for name, keys in sorted(fields.items()))
        raise TypeError(
            f"a mixture batch holds samples with different fields ({detail}), which default_collate "
            "cannot stack: pass collate_fn=stallfree.mix.collate_by_source to batch each source on "
            "its own, or decode= per source to stallfree.mix(...) (then the loader does that itself)"
        )
    return _default_collate(batch)
