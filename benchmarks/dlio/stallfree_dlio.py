"""A DLIO data loader plug-in that runs stallfree.DataLoader inside DLIO's own harness.

DLIO (dlio-benchmark 2.0.0) takes a custom loader by class name::

    ++workload.reader.data_loader_classname=stallfree_dlio.StallfreeDataLoader
    ++workload.reader.data_loader_sampler=index

and then calls ``read()`` once per epoch and iterates ``next()``; its own loop times each batch,
sleeps the compute time, holds a barrier and computes the AU, exactly as for its built-in
``pytorch`` and ``dali`` loaders. The per-sample work is the same as theirs: DLIO's npz reader
opens the sample's file with ``np.load(...)["x"]`` and hands on the configured
``record_length_resize`` image (``dlio_benchmark/reader/npz_reader.py`` and
``reader_handler.py``); here the file is read and parsed the same way (``allow_pickle=False``:
a data file is never unpickled), and the same resized image goes into the batch. What differs
is the loader: stallfree's workers collate straight into shared memory and its order and rank
split are its own (seeded, ``read_threads`` workers, prefetch from DLIO's ``prefetch_size``).
"""

from __future__ import annotations

import io
import logging
import math

import numpy as np
from dlio_benchmark.common.enumerations import DataLoaderType, DatasetType
from dlio_benchmark.data_loader.base_data_loader import BaseDataLoader

logger = logging.getLogger(__name__)


class DLIOFiles:
    """DLIO's generated files as a map-style dataset: one npz sample per file (DLIO's layout for
    the PyTorch loader: ``num_samples_per_file: 1``)."""

    def __init__(self, paths: list[str], resized: np.ndarray) -> None:
        self.paths = list(paths)
        self.resized = resized

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, object]:
        path = self.paths[index]
        with open(path, "rb") as f:
            data = f.read()
        try:
            np.load(io.BytesIO(data), allow_pickle=False)["x"]  # the parse DLIO's reader does
        except (ValueError, OSError, KeyError) as exc:
            raise ValueError(f"{path}: not an npz sample with an array 'x' ({exc})") from exc
        return {"image": self.resized, "nbytes": len(data)}


class StallfreeDataLoader(BaseDataLoader):
    """DLIO ``BaseDataLoader`` backed by ``stallfree.DataLoader``."""

    def __init__(self, format_type, dataset_type, epoch) -> None:
        super().__init__(format_type, dataset_type, epoch, DataLoaderType.CUSTOM)
        self._loader = None

    def read(self) -> None:
        from stallfree import DataLoader
        from stallfree.loader.epoch.world import World

        args = self._args
        paths = args.file_list_train if self.dataset_type is DatasetType.TRAIN else args.file_list_eval
        if args.num_samples_per_file != 1:
            raise ValueError("the stallfree plug-in reads one sample per file (num_samples_per_file: 1)")
        workers = args.read_threads
        options = {}
        if workers > 0:
            options = {
                "persistent_workers": True,
                "prefetch_factor": max(2, math.ceil(args.prefetch_size / workers)),
            }
        self._loader = DataLoader(
            DLIOFiles(paths, args.resized_image),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=workers,
            drop_last=True,
            seed=args.seed,
            world=World(
                rank=args.my_rank, size=args.comm_size, local_rank=args.my_rank, local_size=args.comm_size
            ),
            **options,
        )

    def next(self):
        super().next()
        self._loader.set_epoch(self.epoch_number)
        yield from self._loader
        self.epoch_number += 1

    def finalize(self) -> None:
        """DLIO calls this after every epoch but reads (``read()``) only once: the loader and its
        persistent workers stay for the next epoch, as DLIO's own PyTorch loader's do."""
