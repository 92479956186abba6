"""MLPerf Storage's training workloads, as the numbers its DLIO configs give, and their scaling
to a small host.

MLPerf Storage (DLIO underneath) emulates an accelerator by sleeping a fixed compute time per
batch; a run passes when the accelerators stay busy (accelerator utilisation, AU = compute time /
wall time) at or above a threshold. The values below are copied from the workload configs of the
MLCommons storage benchmark, ``configs/dlio/workload/<model>_<accelerator>.yaml`` in the
``mlcommons/storage`` repository (the same files ship inside ``dlio-benchmark`` 2.0.0 as
``dlio_benchmark/configs/workload/``):

===================  =========  ==============  ============  ===========  ====  ============
config               batch      record bytes    stdev bytes   compute s    AU    read_threads
===================  =========  ==============  ============  ===========  ====  ============
resnet50_h100.yaml   400        114660.07       0             0.224        0.90  8
resnet50_a100.yaml   400        114660.07       0             0.435        0.90  8
unet3d_h100.yaml     7          146600628       68341808      0.323        0.90  4
unet3d_a100.yaml     7          146600628       68341808      0.636        0.90  4
unet3d_b200.yaml     7          146600628       68341808      0.162        0.90  4
cosmoflow_h100.yaml  1          2828486         71311         0.00350      0.70  4
cosmoflow_a100.yaml  1          2828486         71311         0.00551      0.70  4
===================  =========  ==============  ============  ===========  ====  ============

No B200 config exists for ResNet-50 or CosmoFlow; ``unet3d_b200.yaml`` derives its compute time
as the H100's halved ("B200 is ~2x faster than H100"), and the same rule gives theirs here,
marked ``derived`` so the report says so.

A sample of U-Net is 140 MiB on average and a batch of ResNet-50 46 MB: a host with 2 cores and
a few GiB of page cache cannot hold a real data set nor move it at an H100's rate per emulated
accelerator. :meth:`Workload.scaled` divides every record's size by a factor and keeps the batch
and the compute time, so each emulated accelerator asks for ``1/factor`` of the bandwidth a real
one does: N emulated accelerators at the threshold are worth ``N / factor`` real ones in bytes
per second (the report gives both), but not in samples per second, which stay the config's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

WORKLOAD_NAMES = ("resnet50", "unet3d", "cosmoflow")
ACCELERATORS = ("h100", "a100", "b200")

# the factor a bench divides record sizes by unless told otherwise: each keeps a batch within
# tens of MB and a data set within a few hundred MB on this kind of host (2 cores, 24 GiB)
DEFAULT_SCALE = {"resnet50": 1, "unet3d": 64, "cosmoflow": 8}


@dataclass(frozen=True)
class Workload:
    """One MLPerf Storage training workload on one accelerator, as its DLIO config states it
    (``record_bytes`` etc. possibly scaled down, see :meth:`scaled`)."""

    name: str
    accelerator: str
    config: str  # the config file the values come from
    batch_size: int
    record_bytes: float  # mean size of one sample as stored
    record_stdev_bytes: float
    compute_s: float  # emulated compute per batch on this accelerator
    au_threshold: float  # the minimum accelerator utilisation to pass, a fraction
    read_threads: int  # the config's reader threads (DataLoader workers) per accelerator
    data_format: str  # what DLIO stores: tfrecord or npz
    field: str  # the sample's field in our shards: "npz" volumes or "rec" records
    files_train: int  # the config's training files (each ``samples_per_file`` samples)
    samples_per_file: int
    scale: int = 1  # record sizes divided by this
    derived: str = ""  # how a value not in any config was made, when one was

    def scaled(self, factor: int) -> Workload:
        """The same workload with every record ``factor`` times smaller (batch and compute kept)."""
        if not isinstance(factor, int) or factor < 1:
            raise ValueError(f"--scale must be a whole number >= 1, got {factor!r}")
        return replace(
            self,
            record_bytes=self.record_bytes / factor,
            record_stdev_bytes=self.record_stdev_bytes / factor,
            scale=self.scale * factor,
        )

    @property
    def samples_per_s(self) -> float:
        """What one emulated accelerator consumes when it never waits."""
        return self.batch_size / self.compute_s

    @property
    def bytes_per_s(self) -> float:
        """The read bandwidth one emulated accelerator needs to never wait (at this scale)."""
        return self.samples_per_s * self.record_bytes

    def steps_for(self, seconds: float, minimum: int = 8) -> int:
        """Measured steps that take ``seconds`` of emulated compute (at least ``minimum``)."""
        return max(minimum, math.ceil(seconds / self.compute_s))

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "accelerator": self.accelerator,
            "config": self.config,
            "batch_size": self.batch_size,
            "record_bytes": self.record_bytes,
            "record_stdev_bytes": self.record_stdev_bytes,
            "compute_s": self.compute_s,
            "au_threshold": self.au_threshold,
            "read_threads": self.read_threads,
            "data_format": self.data_format,
            "scale": self.scale,
            "derived": self.derived,
            "samples_per_s_per_accelerator": self.samples_per_s,
            "bytes_per_s_per_accelerator": self.bytes_per_s,
        }


def _config(model: str, accelerator: str) -> str:
    return f"mlcommons/storage configs/dlio/workload/{model}_{accelerator}.yaml"


_RESNET = dict(
    batch_size=400,
    record_bytes=114660.07,
    record_stdev_bytes=0.0,
    au_threshold=0.90,
    read_threads=8,
    data_format="tfrecord",
    field="rec",
    files_train=1024,
    samples_per_file=1251,
)
_UNET = dict(
    batch_size=7,
    record_bytes=146600628.0,
    record_stdev_bytes=68341808.0,
    au_threshold=0.90,
    read_threads=4,
    data_format="npz",
    field="npz",
    files_train=168,
    samples_per_file=1,
)
_COSMO = dict(
    batch_size=1,
    record_bytes=2828486.0,
    record_stdev_bytes=71311.0,
    au_threshold=0.70,
    read_threads=4,
    data_format="tfrecord",
    field="rec",
    files_train=524288,
    samples_per_file=1,
)
_HALF_OF_H100 = "compute time = the H100 config's halved, the rule unet3d_b200.yaml states (no {m}_b200.yaml)"

_TABLE: dict[tuple[str, str], Workload] = {
    ("resnet50", "h100"): Workload(
        "resnet50", "h100", _config("resnet50", "h100"), compute_s=0.224, **_RESNET
    ),
    ("resnet50", "a100"): Workload(
        "resnet50", "a100", _config("resnet50", "a100"), compute_s=0.435, **_RESNET
    ),
    ("resnet50", "b200"): Workload(
        "resnet50",
        "b200",
        _config("resnet50", "h100"),
        compute_s=0.224 / 2,
        derived=_HALF_OF_H100.format(m="resnet50"),
        **_RESNET,
    ),
    ("unet3d", "h100"): Workload("unet3d", "h100", _config("unet3d", "h100"), compute_s=0.323, **_UNET),
    ("unet3d", "a100"): Workload("unet3d", "a100", _config("unet3d", "a100"), compute_s=0.636, **_UNET),
    ("unet3d", "b200"): Workload("unet3d", "b200", _config("unet3d", "b200"), compute_s=0.162, **_UNET),
    ("cosmoflow", "h100"): Workload(
        "cosmoflow", "h100", _config("cosmoflow", "h100"), compute_s=0.00350, **_COSMO
    ),
    ("cosmoflow", "a100"): Workload(
        "cosmoflow", "a100", _config("cosmoflow", "a100"), compute_s=0.00551, **_COSMO
    ),
    ("cosmoflow", "b200"): Workload(
        "cosmoflow",
        "b200",
        _config("cosmoflow", "h100"),
        compute_s=0.00350 / 2,
        derived=_HALF_OF_H100.format(m="cosmoflow"),
        **_COSMO,
    ),
}


def workload(name: str, accelerator: str = "h100") -> Workload:
    """The workload ``name`` on ``accelerator``, unscaled; ValueError naming the flag otherwise."""
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"--workload must be one of {', '.join(WORKLOAD_NAMES)}, got {name!r}")
    if accelerator not in ACCELERATORS:
        raise ValueError(f"--accelerator must be one of {', '.join(ACCELERATORS)}, got {accelerator!r}")
    return _TABLE[(name, accelerator)]
