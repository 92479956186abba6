"""Read-only loader adapters for the MLPerf Storage workloads (``--workload``, decode ``none``).

MLPerf Storage measures storage to host memory: DLIO's readers read each record and hand the
batch on without decoding it. These adapters do the same work in each loader: read every
sample's bytes into the training process, batch them, and hand the step a batch
``{"nbytes": Tensor[N]}`` (each sample's size, taken from the bytes that arrived, so nothing is
left unread). Same samples, same batch, same ranks and the same number of workers per rank:

- ``stallfree``: ``stallfree.DataLoader`` over our tar shards, no ``decode=``; the records travel
  from its workers through shared memory (``loaders.StallfreeAdapter`` with decode ``none``)
- ``torch``: ``torch.utils.data.DataLoader`` + ``DistributedSampler`` over the one-file-per-sample
  copy (``ROOT/files``), as DLIO's PyTorch reader reads them; records pickled back from workers
- ``webdataset``: ``webdataset.WebDataset`` over the same tar shards, drawn per worker with
  replacement (``resampled=True``, its advice for multi-rank training)
- ``dali``: DALI's ``fn.readers.webdataset`` over the same tar shards and ``.idx`` (CPU, its own
  threads; ``pipeline.run()`` hands the batch in host memory)
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stallfree.harness.loaders import (
    Adapter,
    LoaderSettings,
    StallfreeAdapter,
    _webdataset_errors,
    loader_available,
    tar_shard_urls,
)
from stallfree.harness.workload_data import files_dir_for

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


class ReadStallfree(StallfreeAdapter):
    """stallfree.DataLoader reading records, no decode."""

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        for batch in super().epoch_iter(epoch):
            fields = [k for k in batch if not k.startswith("__") and k != "cls"]
            if len(fields) != 1:
                raise ValueError(f"expected one record field per sample, got {fields}")
            yield _sizes(batch[fields[0]])

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

    def __getitem__(self, index: int) -> bytes:
        with open(self.paths[index], "rb") as f:
            return f.read()


def _as_list(records: list[bytes]) -> list[bytes]:
    return records


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


def _records(samples: list[dict[str, Any]]) -> list[bytes]:
    return [_payload_field(s) for s in samples]


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
        from stallfree.extras import require

        require("nvidia.dali", "dali", "the DALI loader of stallfree bench (--loader dali)")
        from nvidia.dali import fn, pipeline_def

        from stallfree.shards.tar.idx import idx_path_for

        s = settings
        urls = tar_shard_urls(s.dataset)
        if any("://" in u for u in urls):
            raise ValueError("DALI's webdataset reader reads local files only; this dataset is remote")
        ext = _payload_name(s.dataset[0])
        per_rank = max(1, len(s.dataset) // s.world_size)

        @pipeline_def
        def pipe():
            records = fn.readers.webdataset(
                paths=urls,
                index_paths=[idx_path_for(u) for u in urls],
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
