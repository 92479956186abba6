"""Read-only loader adapters for the MLPerf Storage workloads (``--workload``, decode ``none``).

MLPerf Storage measures storage to host memory: DLIO's readers read each record and hand the
batch on without decoding it. These adapters do the same work in each loader: read every
sample's record into the training process as a uint8 array (the form DLIO's and DALI's readers
hand on, and what a host-to-device copy takes), batch them as a list (sizes differ), and hand the
step a batch ``{"nbytes": Tensor[N]}`` (each record's size, taken from the arrays that arrived,
so nothing is left unread). Same samples, same batch, same ranks, same workers per rank:

- ``stallfree``: ``stallfree.DataLoader`` over our tar shards, ``decode=`` viewing each record as
  a uint8 array; the arrays travel from its workers in shared-memory slots
  (``loaders.StallfreeAdapter`` with decode ``none``)
- ``torch``: ``torch.utils.data.DataLoader`` + ``DistributedSampler`` over the one-file-per-sample
  copy (``ROOT/files``), as DLIO's PyTorch reader reads them, each file read into a uint8 tensor
  (torch moves tensors from its workers through shared memory)
- ``webdataset``: ``webdataset.WebDataset`` over the same tar shards, drawn per worker with
  replacement (``resampled=True``, its advice for multi-rank training)
- ``dali``: DALI's ``fn.readers.webdataset`` over the same tar shards and ``.idx`` (CPU, its own
  threads; ``pipeline.run()`` hands the batch in host memory)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stallfree.harness.loaders import (
    Adapter,
    LoaderSettings,
    StallfreeAdapter,
    _webdataset_errors,
    dali_local_tars,
    loader_available,
    require_dali,
    tar_shard_urls,
)
from stallfree.harness.workload.data import files_dir_for

logger = logging.getLogger(__name__)

READ_LABEL = "none (read only)"


def _payload_name(sample: dict[str, Any]) -> str:
    """The record's field of a sample dict: its one bytes field that is not the key or the label."""
    for name, value in sample.items():
        if not name.startswith("__") and name != "cls" and isinstance(value, (bytes, bytearray, memoryview)):
            return name
    raise ValueError(f"sample {sample.get('__key__')!r} has no record field (fields: {sorted(sample)})")


def _payload_field(sample: dict[str, Any]) -> bytes:
    return sample[_payload_name(sample)]


def _sizes(records: list[Any]) -> dict[str, torch.Tensor]:
    return {"nbytes": torch.tensor([len(r) for r in records], dtype=torch.int64)}


class RecordArray:
    """A sample's record as a uint8 array over its bytes (no copy): what stallfree's workers put
    in the batch's shared-memory slot. Picklable, for the workers."""

    def __call__(self, sample: dict[str, Any]) -> np.ndarray:
        # the slot writer converts the array to a tensor, and torch warns once that a view of
        # immutable bytes is not writable: it is only read from, into the slot
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return np.frombuffer(_payload_field(sample), dtype=np.uint8)


def _as_list(records: list[Any]) -> list[Any]:
    """Records of different sizes stay a list (nothing to stack)."""
    return records


class ReadStallfree(StallfreeAdapter):
    """stallfree.DataLoader reading records into uint8 arrays."""

    def __init__(self, settings: LoaderSettings) -> None:
        extra = {**settings.extra, "decode": RecordArray(), "collate_fn": _as_list}
        super().__init__(dataclasses.replace(settings, decode="none", extra=extra))

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        for records in super().epoch_iter(epoch):
            yield _sizes(records)

    def decode_label(self) -> str:
        return READ_LABEL


class _RecordFiles(torch.utils.data.Dataset):
    """One record per file, in name order; ``__getitem__`` reads the file's bytes."""

    def __init__(self, folder: Path) -> None:
        self.paths = sorted(str(p) for p in folder.iterdir() if p.is_file())
        if not self.paths:
            raise ValueError(f"no record files in {folder}")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.paths[index], "rb") as f:
            size = os.fstat(f.fileno()).st_size
            record = torch.empty(size, dtype=torch.uint8)
            if f.readinto(record.numpy()) != size:
                raise OSError(f"{self.paths[index]}: file shorter than its {size} bytes while read")
        return record


class ReadTorch(Adapter):
    """torch's DataLoader over the one-file-per-sample copy beside the shards."""

    name = "torch"

    def __init__(self, settings: LoaderSettings) -> None:
        super().__init__(settings)
        s = settings
        shards = getattr(s.dataset, "url", None)
        if not shards or "://" in str(shards):
            raise ValueError(
                "the torch workload reader needs local workload data (ROOT/shards beside ROOT/files)"
            )
        folder = files_dir_for(shards)
        if not folder.is_dir():
            raise ValueError(
                f"no per-sample files at {folder}: write the data with stallfree bench --workload"
            )
        files = _RecordFiles(folder)
        if len(files) != len(s.dataset):
            raise ValueError(f"{folder} holds {len(files)} files, the shards {len(s.dataset)} samples")
        self.sampler = torch.utils.data.DistributedSampler(
            files, num_replicas=s.world_size, rank=s.rank, shuffle=True, seed=s.seed, drop_last=True
        )
        self.loader = torch.utils.data.DataLoader(
            files,
            batch_size=s.batch_size,
            sampler=self.sampler,
            num_workers=s.workers,
            collate_fn=_as_list,
            drop_last=True,
            **s.torch_loader_kwargs(),
        )

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        self.sampler.set_epoch(epoch)
        for records in self.loader:
            yield _sizes(records)

    def decode_label(self) -> str:
        return READ_LABEL

    def close(self) -> None:
        from stallfree.loader import _torch_compat as compat

        compat.shutdown_persistent_workers(self.loader)
        super().close()


def _rank_share(urls: Iterator[Any], rank: int, world: int) -> Iterator[Any]:
    """Every ``world``-th shard drawn, from the ``rank``-th: lazily, the draw never ends."""
    return itertools.islice(urls, rank, None, world)


def _records(samples: list[dict[str, Any]]) -> list[torch.Tensor]:
    """A batch of webdataset samples as uint8 tensors (torch moves those from its workers through
    shared memory, bytes it pickles through a pipe)."""
    return [torch.frombuffer(bytearray(_payload_field(s)), dtype=torch.uint8) for s in samples]


class ReadWebDataset(Adapter):
    """webdataset reading the tar shards, each worker drawing shards with replacement."""

    name = "webdataset"

    def __init__(self, settings: LoaderSettings) -> None:
        super().__init__(settings)
        import webdataset as wds

        s = settings
        urls = tar_shard_urls(s.dataset)
        ds = wds.WebDataset(
            urls,
            shardshuffle=False,  # the draw is the shuffle; every rank and worker takes its share of it
            nodesplitter=functools.partial(_rank_share, rank=s.rank, world=s.world_size),
            seed=s.seed,
            empty_check=False,
            handler=_webdataset_errors,
            # shards drawn with replacement per worker, WebDataset's advice for many ranks: a
            # rank's worker may otherwise hold fewer samples than a batch and end its epoch empty
            resampled=True,
        ).shuffle(min(64, s.batch_size), initial=min(64, s.batch_size))
        self.loader = wds.WebLoader(
            ds.batched(s.batch_size, collation_fn=_records, partial=False),
            batch_size=None,
            num_workers=s.workers,
            **s.torch_loader_kwargs(),
        )

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        for records in self.loader:
            yield _sizes(records)

    def decode_label(self) -> str:
        return READ_LABEL


class ReadDali(Adapter):
    """DALI's webdataset reader on the CPU, records out as they are stored."""

    name = "dali"

    def __init__(self, settings: LoaderSettings) -> None:
        super().__init__(settings)
        require_dali()
        from nvidia.dali import fn, pipeline_def

        s = settings
        urls, indexes = dali_local_tars(s.dataset)
        ext = _payload_name(s.dataset[0])
        per_rank = max(1, len(s.dataset) // s.world_size)

        @pipeline_def
        def pipe():
            records = fn.readers.webdataset(
                paths=urls,
                index_paths=indexes,
                ext=[ext],
                missing_component_behavior="error",
                shard_id=s.rank,
                num_shards=s.world_size,
                random_shuffle=True,
                initial_fill=max(s.batch_size, min(1024, per_rank)),
                seed=s.seed + 1,
                name="Reader",
            )
            return records

        self.pipe = pipe(batch_size=s.batch_size, num_threads=max(1, s.workers), device_id=None, seed=s.seed)
        self.pipe.build()

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        # the reader wraps around at its shard's end by itself: one endless stream
        while True:
            (records,) = self.pipe.run()
            yield {"nbytes": torch.tensor([int(shape[0]) for shape in records.shape()], dtype=torch.int64)}

    def decode_label(self) -> str:
        return READ_LABEL

    def close(self) -> None:
        self.__dict__.pop("pipe", None)  # DALI frees its threads and buffers with the pipeline


READ_ADAPTERS: dict[str, type[Adapter]] = {
    "stallfree": ReadStallfree,
    "torch": ReadTorch,
    "webdataset": ReadWebDataset,
    "dali": ReadDali,
}


def make_read_adapter(name: str, settings: LoaderSettings) -> Adapter:
    """The read-only adapter for loader ``name`` (``--workload`` benches: decode ``none``)."""
    reason = loader_available(name)
    if reason:
        raise ValueError(reason)
    if name not in READ_ADAPTERS:
        raise ValueError(f"loader {name!r} has no read-only mode; choose from {', '.join(READ_ADAPTERS)}")
    return READ_ADAPTERS[name](settings)
