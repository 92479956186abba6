"""Data for an MLPerf Storage workload bench, written once into a folder and reused.

``ROOT/shards``: our tar shards (WebDataset layout with DALI ``.idx`` indexes and
``manifest.json``), read by stallfree, WebDataset and DALI alike. ``ROOT/files``: the same
samples one file each (``00000042.npz`` / ``00000042.rec``), the layout DLIO's PyTorch reader and
a plain ``torch.utils.data.Dataset`` read. Each sample is the workload's record: a U-Net volume
as an ``.npz`` (a uint8 array ``x``, as DLIO's npz generator writes one, no pickle), or a record
of seeded random bytes of the size the config gives (ResNet-50's JPEGs and CosmoFlow's
tfrecords: read, never decoded, in MLPerf Storage). Sizes are drawn per sample from a normal
law with the config's mean and deviation (scaled), clipped to [mean / 10, mean + 3 deviations].

``ROOT/workload.json`` records what was asked for; a folder whose record matches is reused as it
is, any other non-empty folder is refused (this never deletes what it did not write).
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stallfree.harness.workload.configs import Workload

logger = logging.getLogger(__name__)

GENERATOR_VERSION = 1
MARKER = "workload.json"
SHARDS = 64  # enough that 8 ranks x 2 workers each read several (WebDataset, DALI split by shard)

# samples written unless told otherwise: enough that a rank of the largest search reads new
# samples for most of its steps, few enough to write in seconds on a small host
DEFAULT_SAMPLES = {"resnet50": 4096, "unet3d": 168, "cosmoflow": 1024}


@dataclass(frozen=True)
class WorkloadData:
    """Where a workload's data lies, in each layout, and what it holds."""

    root: Path
    record: dict[str, Any]

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def files(self) -> Path:
        return self.root / "files"

    @property
    def samples(self) -> int:
        return int(self.record["samples"])

    @property
    def mean_bytes(self) -> float:
        return float(self.record["mean_bytes"])


def files_dir_for(shards: str | Path) -> Path:
    """The one-file-per-sample copy beside a workload's ``shards`` folder (torch's reader)."""
    return Path(shards).parent / "files"


def record_sizes(workload: Workload, samples: int, seed: int) -> list[int]:
    """Each sample's stored size: the config's mean and deviation (scaled), clipped."""
    mean, sd = workload.record_bytes, workload.record_stdev_bytes
    rng = np.random.default_rng(seed)
    drawn = rng.normal(mean, sd, samples) if sd > 0 else np.full(samples, mean)
    clipped = np.clip(drawn, max(1.0, mean / 10), mean + 3 * sd)
    return [int(round(v)) for v in clipped]


def encode_sample(workload: Workload, size: int, rng: np.random.Generator) -> bytes:
    """One record of about ``size`` bytes: an npz volume (U-Net) or raw record bytes."""
    if workload.field == "npz":
        payload = np.frombuffer(rng.bytes(max(1, size - 256)), dtype=np.uint8)  # ~256 B of zip+npy headers
        buf = io.BytesIO()
        np.savez(buf, x=payload)
        return buf.getvalue()
    return rng.bytes(size)


def prepare(root: str | Path, workload: Workload, samples: int, *, seed: int = 0) -> WorkloadData:
    """The data in ``root`` (reused when its record matches; else written: ``root`` must then be
    absent, empty, or a folder this wrote before)."""
    from stallfree import ShardWriter

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    root = Path(root)
    want = {
        "generator": GENERATOR_VERSION,
        "workload": workload.name,
        "field": workload.field,
        "record_bytes": workload.record_bytes,
        "record_stdev_bytes": workload.record_stdev_bytes,
        "samples": samples,
        "seed": seed,
    }
    marker = root / MARKER
    if marker.exists():
        try:
            record = json.loads(marker.read_text())
        except ValueError:
            record = {}
        if all(record.get(k) == v for k, v in want.items()):
            return WorkloadData(root, record)
    elif root.exists() and any(root.iterdir()):
        raise ValueError(
            f"{root} is not empty and holds no {MARKER}: not workload data; pick an empty folder"
        )
    for part in ("shards", "files"):
        shutil.rmtree(root / part, ignore_errors=True)
    marker.unlink(missing_ok=True)  # a half-written folder never passes for a whole one
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    sizes = record_sizes(workload, samples, seed)
    rng = np.random.default_rng(seed + 1)
    total = 0
    logger.info(
        "writing %d %s samples (%.1f MB mean) into %s",
        samples,
        workload.name,
        workload.record_bytes / 1e6,
        root,
    )
    per_shard = max(1, -(-samples // SHARDS))
    with ShardWriter(str(root / "shards"), format="tar", max_samples=per_shard, max_bytes=2**40) as writer:
        for i, size in enumerate(sizes):
            data = encode_sample(workload, size, rng)
            total += len(data)
            key = f"{i:08d}"
            writer.write({"__key__": key, workload.field: data, "cls": str(i % 1000).encode()})
            (files / f"{key}.{workload.field}").write_bytes(data)
    record = {**want, "mean_bytes": total / samples, "total_bytes": total}
    tmp = root / (MARKER + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(marker)
    return WorkloadData(root, record)
