"""Loader adapters: each turns (dataset, rank, settings) into an endless stream of batches
``{"image": Tensor[N,3,S,S], "label": Tensor[N]}`` so the harness compares loaders on the same data,
the same per-sample work, the same step and the same ranks.

- ``synthetic``: one pre-built batch served again and again (the ingestion ceiling; no I/O, no decode)
- ``torch``: ``torch.utils.data.DataLoader`` + ``DistributedSampler`` + the PIL recipe in workers
- ``stallfree``: ``stallfree.DataLoader`` (clairvoyant order, prefetch), same recipe or ``ImageDecode``
- ``stallfree-remote``: the same loader plus ``remote=stallfree.RayWorkers(...)``: remote workers on
  a Ray cluster's CPU nodes beside the local ones (needs the ``ray`` extra and a cluster)
- ``webdataset``: ``webdataset.WebDataset`` over the tar shards, split by rank and worker
- ``dali``: DALI's own ``fn.readers.webdataset`` + decode and augment (CPU operators, or mixed
  decode on the GPU when the device is CUDA; local tar shards only)
"""

from __future__ import annotations

import abc
import functools
import importlib.util
import itertools
import logging
import multiprocessing
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.errors import CorruptShardError
from stallfree.gpu_decode.augment import IMAGENET_MEAN, IMAGENET_STD
from stallfree.harness.config import REMOTE_LOADER, RemoteSpec
from stallfree.harness.report import RECIPE_LABEL
from stallfree.harness.transforms import PILRecipe, collate_pairs
from stallfree.loader import _torch_compat as compat

logger = logging.getLogger(__name__)


@dataclass
class LoaderSettings:
    """What every adapter is given; ``dataset`` is already opened in this rank's process."""

    dataset: Any
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_size: int = 1
    batch_size: int = 32
    workers: int = 2
    prefetch: int | None = None
    image_size: int = 64
    seed: int = 0
    decode: str = "auto"  # stallfree only: "recipe" (PIL, per sample), "image-decode", "auto"
    device: str = "cpu"
    worker_start: str = "forkserver"  # how loader workers start: fork | forkserver | spawn
    extra: dict[str, Any] = field(default_factory=dict)
    remote: RemoteSpec | None = None  # stallfree-remote only: its remote workers

    def mp_context(self) -> Any:
        """The multiprocessing context every loader's workers start from (the same for all).

        Forking a rank that already runs threads (gloo, fsspec's event loop) can leave a worker
        with broken locks; a fork server started before those threads avoids that. The server
        preloads torch and the harness so workers start fast.
        """
        if self.workers == 0:
            return None
        ctx = multiprocessing.get_context(self.worker_start)
        if self.worker_start == "forkserver":
            ctx.set_forkserver_preload(["torch", "stallfree.harness.loaders", "stallfree.harness.datasets"])
        return ctx

    def torch_loader_kwargs(self) -> dict[str, Any]:
        """Keywords for a torch-style DataLoader (torch's, webdataset's WebLoader): persistent
        workers from :meth:`mp_context`, the prefetch factor when set, pinned memory for CUDA."""
        kwargs: dict[str, Any] = {"pin_memory": self.device.startswith("cuda")}
        if self.workers > 0:
            kwargs["persistent_workers"] = True
            kwargs["multiprocessing_context"] = self.mp_context()
            if self.prefetch:
                kwargs["prefetch_factor"] = self.prefetch
        return kwargs


class Adapter(abc.ABC):
    """An endless batch stream plus what the loader reports about itself."""

    name = "base"

    def __init__(self, settings: LoaderSettings) -> None:
        self.settings = settings

    @abc.abstractmethod
    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        """One epoch's batches."""

    def batches(self) -> Iterator[Any]:
        """Batches across epochs, forever (the harness stops after its step count)."""
        epoch = 0
        while True:
            produced = False
            for batch in self.epoch_iter(epoch):
                produced = True
                yield batch
            if not produced:
                raise RuntimeError(
                    f"loader {self.name!r} produced no batch in epoch {epoch}: dataset smaller than "
                    f"batch_size x ranks x workers?"
                )
            epoch += 1

    def stats(self) -> dict[str, Any]:
        return {}

    def decode_label(self) -> str:
        """Which decode this loader ran, for the report: loaders differ in more than their I/O,
        so the table says what each one decoded with (read after the run, when known)."""
        return RECIPE_LABEL

    def close(self) -> None:
        """Drop the loader once the run is over, so its workers and files are released."""
        self.__dict__.pop("loader", None)


class _Mapped(torch.utils.data.Dataset):
    """Map-style view of ``dataset`` with ``fn`` applied per sample (runs in the loader workers)."""

    def __init__(self, dataset: Any, fn: Callable[[dict[str, Any]], Any]) -> None:
        self.dataset, self.fn = dataset, fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.fn(self.dataset[index])


class SyntheticBatches(Adapter):
    """The same in-memory batch every step: what the step rate is when data costs nothing."""

    name = "synthetic"

    def __init__(self, settings: LoaderSettings) -> None:
        super().__init__(settings)
        s, b = settings.image_size, settings.batch_size
        gen = torch.Generator().manual_seed(settings.seed)
        self._batch = {
            "image": torch.randn(b, 3, s, s, generator=gen),
            "label": torch.zeros(b, dtype=torch.long),
        }

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        return itertools.repeat(self._batch)

    def decode_label(self) -> str:
        return "none (in-memory batch)"


class TorchAdapter(Adapter):
    """torch's DataLoader with DistributedSampler and the PIL decode recipe in its workers."""

    name = "torch"

    def __init__(self, settings: LoaderSettings) -> None:
        super().__init__(settings)
        s = settings
        self.sampler = torch.utils.data.DistributedSampler(
            s.dataset, num_replicas=s.world_size, rank=s.rank, shuffle=True, seed=s.seed, drop_last=True
        )
        self.loader = torch.utils.data.DataLoader(
            _Mapped(s.dataset, PILRecipe(s.image_size, s.seed)),
            batch_size=s.batch_size,
            sampler=self.sampler,
            num_workers=s.workers,
            collate_fn=collate_pairs,
            drop_last=True,
            **s.torch_loader_kwargs(),  # pinned memory on CUDA: the standard recipe for GPU training
        )

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        self.sampler.set_epoch(epoch)
        return iter(self.loader)

    def close(self) -> None:
        compat.shutdown_persistent_workers(self.loader)
        super().close()


class StallfreeAdapter(Adapter):
    """stallfree.DataLoader: seeded epoch order split by rank, clairvoyant prefetch."""

    name = "stallfree"

    def __init__(self, settings: LoaderSettings) -> None:
        super().__init__(settings)
        from stallfree.loader.dataloader import DataLoader
        from stallfree.loader.epoch.world import World

        s = settings
        world = World(rank=s.rank, size=s.world_size, local_rank=s.local_rank, local_size=s.local_size)
        kwargs: dict[str, Any] = dict(s.extra)
        decode = "image-decode" if s.decode == "auto" else s.decode  # ImageDecode ships with stallfree
        if decode == "image-decode":
            from stallfree.gpu_decode.select import ImageDecode

            kwargs["decode"] = ImageDecode(train=True, size=s.image_size, backend="auto")
        elif decode == "recipe":
            kwargs["decode"] = PILRecipe(s.image_size, s.seed)
            kwargs["collate_fn"] = collate_pairs
        elif decode != "none":  # none: the samples as stored (the --workload benches, workload_loaders.py)
            raise ValueError(f"unknown decode mode {decode!r}; choose auto, recipe or image-decode")
        if s.workers > 0:
            kwargs["persistent_workers"] = True
            # stallfree keeps its own (fork) start method unless told spawn; its workers also run
            # under a fork server now (liveness via the parent sentinel), not measured here yet.
            if s.worker_start == "spawn":
                kwargs["multiprocessing_context"] = s.mp_context()
            if s.prefetch:
                kwargs["prefetch_factor"] = s.prefetch
        self.decode_mode = decode
        self.loader = DataLoader(
            s.dataset,
            batch_size=s.batch_size,
            shuffle=True,
            num_workers=s.workers,
            drop_last=True,
            seed=s.seed,
            world=world,
            device=None if s.device == "cpu" else s.device,
            **self._remote_kwargs(),
            **kwargs,
        )

    def _remote_kwargs(self) -> dict[str, Any]:
        """More ``stallfree.DataLoader`` keywords (the remote adapter's ``remote=``)."""
        return {}

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def stats(self) -> dict[str, Any]:
        try:
            return {"decode_mode": self.decode_mode, **dict(self.loader.stats())}
        except Exception as exc:  # stats are informative only; never fail a bench over them
            logger.warning("stallfree loader stats failed: %s", exc)
            return {"decode_mode": self.decode_mode}

    def decode_label(self) -> str:
        """``ImageDecode <backend> in <workers|main>`` from the loader's own stats, or the recipe's label."""
        if self.decode_mode == "recipe":
            return RECIPE_LABEL
        decode = self.stats().get("decode") or {}
        backend, where = decode.get("backend"), decode.get("where")
        return "ImageDecode" + "".join(f" {v}" for v in (backend, where and f"in {where}") if v)

    def close(self) -> None:
        closer = getattr(self.loader, "close", None)
        if callable(closer):
            closer()
        super().close()  # the loader shuts its workers down when collected


class StallfreeRemoteAdapter(StallfreeAdapter):
    """stallfree.DataLoader with remote workers on Ray beside its local ones: the same loader,
    order and decode as ``stallfree``, so the two side by side show the stall with and without
    remote workers. The loader's ``close`` stops the actors."""

    name = REMOTE_LOADER

    def _remote_kwargs(self) -> dict[str, Any]:
        spec = self.settings.remote if self.settings.remote is not None else RemoteSpec()
        return {"remote": spec.ray_workers()}


def _split_by_rank(urls: list[str], rank: int, world: int) -> list[str]:
    return list(urls)[rank::world]


def tar_shard_urls(dataset: Any) -> list[str]:
    """Full URLs (plain paths when local) of a tar-format shard dataset's shards, in order."""
    manifest = getattr(dataset, "manifest", None)
    if manifest is None or not hasattr(dataset, "shard_path"):
        raise ValueError("this loader needs a tar shard dataset (a directory or URL with manifest.json)")
    if getattr(manifest, "format", "tar") != "tar":
        raise ValueError(f"this loader reads tar shards; the dataset is {manifest.format!r}")
    fs = dataset.fs
    local = "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))
    paths = [dataset.shard_path(i) for i in range(len(manifest.shards))]
    return paths if local else [fs.unstrip_protocol(p) for p in paths]


def _webdataset_errors(exc: Exception) -> bool:
    """webdataset's error handler: a damaged tar (cut short, bad header) is bad data, so a
    CorruptShardError naming the shard, not tarfile's bare error. webdataset calls this first
    inside the tar iterator (no URL yet: re-raise) and again once it has added the source's
    stream and URL to the arguments."""
    url = exc.args[-1] if len(exc.args) >= 3 and isinstance(exc.args[-1], str) else None
    if isinstance(exc, tarfile.TarError) and url is not None:
        reason = str(exc.args[0]).split(" @ ", 1)[0]
        raise CorruptShardError(f"cannot read tar: {reason}", shard=url.rsplit("/", 1)[-1]) from exc
    raise exc


class WebDatasetAdapter(Adapter):
    """webdataset reading the same tar shards sequentially, shards split across ranks and workers."""

    name = "webdataset"

    def __init__(self, settings: LoaderSettings) -> None:
        super().__init__(settings)
        import webdataset as wds

        s = settings
        urls = tar_shard_urls(s.dataset)
        if len(urls) < s.world_size * max(1, s.workers):
            logger.warning(
                "webdataset: %d shards for %d ranks x %d workers; some workers get none",
                len(urls),
                s.world_size,
                s.workers,
            )
        ds = (
            wds.WebDataset(
                urls,
                shardshuffle=len(urls),
                nodesplitter=functools.partial(_split_by_rank, rank=s.rank, world=s.world_size),
                seed=s.seed,
                empty_check=False,
                handler=_webdataset_errors,
            )
            .shuffle(64, initial=64)
            .map(PILRecipe(s.image_size, s.seed))
        )
        self.loader = wds.WebLoader(
            ds.batched(s.batch_size, collation_fn=collate_pairs, partial=False),
            batch_size=None,
            num_workers=s.workers,
            **s.torch_loader_kwargs(),
        )

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        return iter(self.loader)


def require_dali() -> None:
    """DALI installed, or the error naming the extra that brings it."""
    from stallfree.extras import require

    require("nvidia.dali", "dali", "the DALI loader of stallfree bench (--loader dali)")


def dali_local_tars(dataset: Any) -> tuple[list[str], list[str] | None]:
    """``dataset``'s tar shards for DALI's webdataset reader, with their ``.idx`` files (None when
    any is missing: DALI then infers the index by scanning the tars); DALI reads local files only."""
    from stallfree.shards.tar.idx import idx_path_for

    urls = tar_shard_urls(dataset)
    if any("://" in u for u in urls):
        raise ValueError("DALI's webdataset reader reads local files only; this dataset is remote")
    indexes = [idx_path_for(u) for u in urls]
    return urls, indexes if all(os.path.exists(p) for p in indexes) else None


class DaliAdapter(Adapter):
    """DALI's own webdataset reader and CPU operators (device_id=None; GPU ops when a GPU is given)."""

    name = "dali"

    def __init__(self, settings: LoaderSettings) -> None:
        super().__init__(settings)
        require_dali()
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        s = settings
        urls, indexes = dali_local_tars(s.dataset)
        gpu = s.device.startswith("cuda")

        @pipeline_def
        def pipe():
            jpegs, labels = fn.readers.webdataset(
                paths=urls,
                index_paths=indexes,
                ext=["jpg", "cls"],
                missing_component_behavior="error",
                shard_id=s.rank,
                num_shards=s.world_size,
                random_shuffle=True,
                seed=s.seed + 1,
                name="Reader",
            )
            images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
            images = fn.random_resized_crop(images, size=[s.image_size, s.image_size])
            images = fn.crop_mirror_normalize(
                images,
                dtype=types.FLOAT,
                output_layout="CHW",
                mean=list(IMAGENET_MEAN),
                std=list(IMAGENET_STD),
                mirror=fn.random.coin_flip(),
            )
            return images, labels

        device_id = (int(s.device.split(":")[1]) if ":" in s.device else s.local_rank) if gpu else None
        self.pipe = pipe(
            batch_size=s.batch_size, num_threads=max(1, s.workers), device_id=device_id, seed=s.seed
        )
        self.pipe.build()
        self.iterator = DALIGenericIterator(
            [self.pipe],
            ["image", "label"],
            reader_name="Reader",
            last_batch_policy=LastBatchPolicy.DROP,
            auto_reset=True,
        )

    def close(self) -> None:
        self.__dict__.pop("iterator", None)
        self.__dict__.pop("pipe", None)  # DALI frees its threads and buffers with the pipeline

    def decode_label(self) -> str:
        return "DALI mixed (GPU)" if self.settings.device.startswith("cuda") else "DALI cpu"

    def epoch_iter(self, epoch: int) -> Iterator[Any]:
        for out in self.iterator:
            batch = out[0]
            yield {"image": batch["image"], "label": _dali_labels(batch["label"])}


def _dali_labels(raw: torch.Tensor) -> torch.Tensor:
    """DALI hands ``cls`` as padded ASCII bytes per sample; parse them into int64 labels."""
    rows = raw.reshape(raw.shape[0], -1).to(torch.uint8).cpu().tolist()
    return torch.tensor([int(bytes(v for v in row if v).decode("ascii").strip() or 0) for row in rows])


ADAPTERS: dict[str, type[Adapter]] = {
    "synthetic": SyntheticBatches,
    "torch": TorchAdapter,
    "stallfree": StallfreeAdapter,
    REMOTE_LOADER: StallfreeRemoteAdapter,
    "webdataset": WebDatasetAdapter,
    "dali": DaliAdapter,
}

# Third-party packages an adapter needs (stallfree's own loader and decoders always ship).
_REQUIRES = {
    "webdataset": "webdataset",
    "dali": "nvidia.dali",
    REMOTE_LOADER: "ray",
}


def loader_available(name: str) -> str | None:
    """None when loader ``name`` can run here, else the reason it cannot."""
    if name not in ADAPTERS:
        return f"unknown loader {name!r}; choose from {', '.join(ADAPTERS)}"
    module = _REQUIRES.get(name)
    if module:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{module} is not installed"
    return None


def make_adapter(name: str, settings: LoaderSettings) -> Adapter:
    """The adapter for loader ``name`` (see :data:`ADAPTERS`)."""
    reason = loader_available(name)
    if reason:
        raise ValueError(reason)
    return ADAPTERS[name](settings)
