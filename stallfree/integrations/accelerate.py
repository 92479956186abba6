"""``Accelerator``: accelerate's ``Accelerator`` that keeps a ``stallfree.DataLoader`` as it is.

Swap the import and nothing else changes::

    from stallfree.integrations.accelerate import Accelerator

    accelerator = Accelerator()
    loader = stallfree.DataLoader(dataset, batch_size=32, num_workers=4, decode=...,
                                  device=accelerator.device)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)   # ours comes back
    accelerator.load_state("ckpt")        # the loader goes on from where the checkpoint stood
    ...
    accelerator.save_state("ckpt")        # the loader's state is saved with the rest, as JSON

Why: stock ``prepare`` rebuilds any ``DataLoader`` as its own ``DataLoaderShard`` from
``loader.dataset`` (``decode=``, the fast path, ``stats()`` and the resume state are gone, and it
shards the data by rank a second time), and ``save_state`` keeps no state of a loader it did not
build; ``register_for_checkpointing`` would, but pickles it and must be known to be needed.
Here ``prepare_data_loader`` checks our loader (own order, split for this process's rank) and
returns the same object; ``save_state`` / ``load_state`` carry every prepared loader's state in
``stallfree_loader_state.json`` (``state_file.py``) through accelerate's public save / load
pre-hooks. A checkpoint loaded before its loader is prepared keeps the state for it.

Batches are not moved by accelerate: give the loader ``device=accelerator.device`` (it copies on a
side CUDA stream), or prepare it with ``device_placement=False`` and move them yourself.
"""

from __future__ import annotations

import logging
from typing import Any

from stallfree.extras import require

accelerate = require("accelerate", "hf", "stallfree.integrations.accelerate")

from stallfree.integrations import loader_facts, state_file  # noqa: E402
from stallfree.loader.dataloader import DataLoader  # noqa: E402

logger = logging.getLogger(__name__)

_WHO = "stallfree Accelerator.prepare"


class Accelerator(accelerate.Accelerator):
    """accelerate's ``Accelerator`` that returns a ``stallfree.DataLoader`` from ``prepare`` as it
    is and saves / restores its state with ``save_state`` / ``load_state`` (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stallfree_loaders: list[DataLoader] = []
        self._pending_loader_states: list[dict[str, Any]] = []  # loaded before their loader was prepared
        # a checkpoint without loader states, loaded before any loader of ours was prepared
        self._loaded_without_states: state_file.MissingLoaderStateError | None = None
        self.register_save_state_pre_hook(self._save_loader_states)
        self.register_load_state_pre_hook(self._load_loader_states)

    @property
    def stallfree_loaders(self) -> tuple[DataLoader, ...]:
        """The stallfree loaders prepared so far, in the order their states are saved."""
        return tuple(self._stallfree_loaders)

    def prepare_data_loader(
        self, data_loader: Any, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        """Ours: checked and returned as it is (and remembered for ``save_state``); any other
        loader: accelerate's own preparation."""
        if not isinstance(data_loader, DataLoader):
            return super().prepare_data_loader(
                data_loader, device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch
            )
        loader = loader_facts.require_own_order(data_loader, who=_WHO)
        loader_facts.check_world(loader, rank=self.process_index, size=self.num_processes, who=_WHO)
        if self.split_batches or self.dispatch_batches:
            raise ValueError(
                f"{_WHO}: split_batches / dispatch_batches hand one process's batches to all of them; a "
                "stallfree.DataLoader already reads each process's own share (its batch_size is per process)"
            )
        placement = self.device_placement if device_placement is None else device_placement
        if placement and self.device.type != "cpu" and loader.device is None:
            raise ValueError(
                f"{_WHO}: this loader leaves batches on the CPU and accelerate does not move them; build it with "
                "device=accelerator.device (a side-stream copy), or prepare it with device_placement=False "
                "and move batches yourself"
            )
        if not any(loader is known for known in self._stallfree_loaders):
            if self._loaded_without_states is not None:  # as load_state refuses it after prepare
                raise self._loaded_without_states
            self._stallfree_loaders.append(loader)
            if self._pending_loader_states:
                loader.load_state_dict(self._pending_loader_states.pop(0))
        return loader

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Ours as it is: ``load_state`` already put it where the checkpoint stood, and skipping
        again would lose ``num_batches`` batches."""
        if isinstance(dataloader, DataLoader):
            if num_batches:
                logger.info(
                    "skip_first_batches(%d) on a stallfree.DataLoader: not skipped, its state resumes it",
                    num_batches,
                )
            return dataloader
        return super().skip_first_batches(dataloader, num_batches)

    def free_memory(self, *objects: Any) -> Any:
        self._stallfree_loaders = []
        self._pending_loader_states = []
        self._loaded_without_states = None
        return super().free_memory(*objects)

    # -- save_state / load_state pre-hooks -----------------------------------------------------
    def _writes_checkpoint_files(self) -> bool:
        """The process that writes accelerate's own checkpoint files (per node when asked)."""
        if self.project_configuration.save_on_each_node:
            return self.is_local_main_process
        return self.is_main_process

    def _save_loader_states(self, models: Any, weights: Any, output_dir: str) -> None:
        if self._stallfree_loaders and self._writes_checkpoint_files():
            state_file.write(
                output_dir,
                [loader.state_dict() for loader in self._stallfree_loaders],
                step=self.step,
                world_size=self.num_processes,
            )

    def _load_loader_states(self, models: Any, input_dir: str) -> None:
        try:
            saved = state_file.read(input_dir)
        except state_file.MissingLoaderStateError as missing:
            if self._stallfree_loaders:
                raise
            # no loader of ours yet: one prepared later would start over, so its prepare refuses
            self._loaded_without_states = missing
            self._pending_loader_states = []
            return
        self._loaded_without_states = None
        states = list(saved.loaders)
        if len(self._stallfree_loaders) > len(states):
            raise state_file.LoaderStateFileError(
                f"{len(states)} loader states saved, {len(self._stallfree_loaders)} stallfree loaders prepared",
                path=str(state_file.path_in(input_dir)),
            )
        for loader, state in zip(self._stallfree_loaders, states, strict=False):
            loader.load_state_dict(state)
        self._pending_loader_states = states[len(self._stallfree_loaders) :]
