"""``Trainer``: transformers' ``Trainer`` with a ``stallfree.DataLoader`` as its train loader.

Swap the import and nothing else changes::

    from stallfree.integrations.transformers import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      loader_options={"decode": ImageDecode(...), "cache": cache})
    trainer.train(resume_from_checkpoint=True)

Why a subclass: the stock ``Trainer`` builds a torch ``DataLoader`` from ``train_dataset`` and
hands it to accelerate (which replaces any loader with its own), and on a mid-epoch resume it
rebuilds the loader to skip the batches already trained on (``skip_first_batches``), which for
our loader lost and repeated samples. Here:

- ``get_train_dataloader`` builds our loader from ``train_dataset`` and ``TrainingArguments``
  (per-device batch size, workers, pinning, ``dataloader_drop_last``, ``data_seed`` or ``seed``
  as the epoch order's seed) plus ``loader_options`` (ours: ``decode``, ``cache``, ``order``,
  ...). It is split by rank once, by itself; accelerate never sees it.
- Every checkpoint gets ``stallfree_loader_state.json`` (``state_file.py``) beside Trainer's
  files, written before ``trainer_state.json`` so a checkpoint Trainer would resume from has it.
- A resume loads it and starts the epoch where the loader stands, without batch skipping; the
  epoch and its batches already done come from the loader, so a resume on another number of
  processes also trains on every sample once (Trainer's own arithmetic assumes the same world).
- Columns the model's ``forward`` does not take are dropped from each batch in the training
  process (``remove_unused_columns``, as Trainer's collator wrapper does for its own loader).

Only the train loader is ours; evaluation keeps Trainer's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from stallfree.extras import require

transformers = require("transformers", "hf", "stallfree.integrations.transformers")

import torch  # noqa: E402  (after the check above, so a missing transformers is the error shown)
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

from stallfree.integrations import loader_facts, state_file  # noqa: E402
from stallfree.loader.dataloader import DataLoader  # noqa: E402

logger = logging.getLogger(__name__)

# set from TrainingArguments (or fixed by the Trainer's contract), so not accepted in loader_options
_FROM_ARGS = {
    "batch_size": "per_device_train_batch_size",
    "num_workers": "dataloader_num_workers",
    "pin_memory": "dataloader_pin_memory",
    "persistent_workers": "dataloader_persistent_workers",
    "prefetch_factor": "dataloader_prefetch_factor",
    "multiprocessing_context": "dataloader_multiprocessing_context",
    "drop_last": "dataloader_drop_last",
    "in_order": "dataloader_in_order",
}
_FIXED = {
    "dataset": "Trainer's train_dataset",
    "collate_fn": "Trainer's data_collator",
    "shuffle": "TrainingArguments.train_sampling_strategy",
    "sampler": "the loader's own order",
    "batch_sampler": "the loader's own order",
    "world": "torch.distributed, as Trainer starts it",
}
_ORDERS = {"random": None, "sequential": "sequential"}  # train_sampling_strategy -> our order
# collators that hand the dataset's labels through as they are (padding at most)
_LABEL_KEEPING_COLLATORS = (transformers.DataCollatorWithPadding, transformers.DefaultDataCollator)


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` whose train loader is a ``stallfree.DataLoader`` (see the module
    docstring). ``loader_options``: our ``DataLoader`` keyword options (``decode``, ``cache``,
    ``order``, ``window``, ``seed``, ``device``, ``on_error``, ...); the torch ones come from
    ``TrainingArguments`` as for Trainer's own loader."""

    def __init__(self, *args: Any, loader_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        options = dict(loader_options or {})
        clash = sorted(set(options) & {*_FROM_ARGS, *_FIXED})
        if clash:
            told = ", ".join(
                f"{k} (TrainingArguments.{_FROM_ARGS[k]})" if k in _FROM_ARGS else f"{k} ({_FIXED[k]})"
                for k in clash
            )
            raise ValueError(f"loader_options may not set {told}")
        self._loader_options = options
        self._stallfree_loader: DataLoader | None = None
        self._dropped_logged = False
        self._resuming_from: str | None = None  # the checkpoint train() resumes from, while it runs
        super().__init__(*args, **kwargs)

    # -- the loader ----------------------------------------------------------------------------
    @property
    def train_loader(self) -> DataLoader | None:
        """The ``stallfree.DataLoader`` training runs on (None before ``train()`` builds it):
        ``stats()``, ``state_dict()``."""
        return self._stallfree_loader

    def get_train_dataloader(self) -> DataLoader:
        """Our loader over ``train_dataset`` (built once per dataset and batch size; kept across
        ``train()`` calls, so a second call goes on from where the first stopped)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        loader = self._stallfree_loader
        if (
            loader is None
            or loader.batch_size != self._train_batch_size
            or loader.dataset is not self.train_dataset
        ):
            if loader is not None:
                loader.close()
            loader = self._stallfree_loader = self._build_loader(self._train_batch_size)
        loader_facts.check_world(
            loader, rank=self.args.process_index, size=self.args.world_size, who="stallfree Trainer"
        )
        return loader

    def _build_loader(self, batch_size: int) -> DataLoader:
        args = self.args
        strategy = args.train_sampling_strategy
        if strategy not in _ORDERS:
            raise ValueError(
                f"train_sampling_strategy={strategy!r} is Trainer's own sampler; with stallfree's loader use "
                f"'random' (our seeded shuffle, or the order= of loader_options) or 'sequential'"
            )
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise TypeError(
                "stallfree Trainer needs a map-style train_dataset (__len__ and __getitem__ or get_many): an "
                "IterableDataset decides itself what each rank reads, so the loader cannot split or resume it"
            )
        self._check_label_convention(self.train_dataset, "train_dataset")
        options: dict[str, Any] = {
            "seed": args.data_seed if args.data_seed is not None else args.seed,
            "device": args.device if args.device.type == "cuda" else None,
        }
        if _ORDERS[strategy] is not None:
            options["order"] = _ORDERS[strategy]
        options.update(self._loader_options)
        workers = args.dataloader_num_workers
        loader = DataLoader(
            self.train_dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            collate_fn=self._collate_fn(),
            pin_memory=bool(args.dataloader_pin_memory and torch.cuda.is_available()),
            drop_last=args.dataloader_drop_last,
            multiprocessing_context=args.dataloader_multiprocessing_context if workers else None,
            prefetch_factor=args.dataloader_prefetch_factor if workers else None,
            persistent_workers=bool(args.dataloader_persistent_workers and workers),
            in_order=args.dataloader_in_order,
            **options,
        )
        return loader_facts.require_own_order(loader, who="stallfree Trainer")

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Trainer's own evaluation loader, after the same label check as for training (an
        evaluation loss against token t+2 looks as plausible as a training one)."""
        chosen = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(chosen, str) and isinstance(self.eval_dataset, Mapping):
            chosen = self.eval_dataset.get(chosen)
        if isinstance(chosen, Mapping):
            for name, dataset in chosen.items():
                self._check_label_convention(dataset, f"eval_dataset[{name!r}]")
        else:
            self._check_label_convention(chosen, "eval_dataset")
        return super().get_eval_dataloader(eval_dataset)

    def _check_label_convention(self, dataset: Any, role: str) -> None:
        """Refuse labels shifted twice. ``TokenDataset``'s default labels are the inputs shifted
        by one (``labels="shifted"``); a causal-LM loss shifts them again, so the model would learn
        token t+2, with a loss that still falls. The dataset cannot see the model; the Trainer
        sees both. Left alone: a loss of your own, or a collator that rebuilds ``labels``."""
        for _ in range(4):  # Subset(TokenDataset) and the like
            if getattr(dataset, "labels", None) == "shifted":
                break
            dataset = getattr(dataset, "dataset", None)
        else:
            return
        if dataset is None or self.compute_loss_func is not None:
            return
        if not isinstance(self.data_collator, _LABEL_KEEPING_COLLATORS) and self.data_collator not in (
            None,
            transformers.default_data_collator,
        ):
            return
        model = self.accelerator.unwrap_model(self.model)
        shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
        if shifts and not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise ValueError(
                f"{role} gives labels='shifted' (labels[i] = input_ids[i + 1]) and "
                f"{type(model).__name__} shifts them again: it would learn token t+2. Build the dataset "
                "with labels='inputs' (TokenDataset(..., labels='inputs'): labels equal input_ids, as "
                "Hugging Face causal LMs expect)"
            )

    def _collate_fn(self) -> Any:
        """The user's ``data_collator``; None (our collate into shared memory, the same dict of
        stacked tensors) for Trainer's stock ``default_data_collator``."""
        if self.data_collator is transformers.default_data_collator:
            return None
        return self.data_collator

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The loader as it is: the checkpoint's state already put it where training stopped
        (Trainer's default rebuilds it to skip ``num_batches``)."""
        if dataloader is self._stallfree_loader:
            return dataloader
        return super().get_resumed_dataloader(dataloader, num_batches)

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's checkpoint with the loader's state beside it, written first, so a checkpoint
        holding ``trainer_state.json`` (what a resume reads) holds it too. The state is a global
        position, the same on every rank: the process that saves Trainer's files writes it once."""
        loader = self._stallfree_loader
        if loader is not None and self.args.should_save:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            directory = os.path.join(self._get_output_dir(trial=trial), folder)
            state_file.write(
                directory, [loader.state_dict()], step=self.state.global_step, world_size=self.args.world_size
            )
        super()._save_checkpoint(model, trial)

    def _inner_training_loop(
        self,
        batch_size: int | None = None,
        args: Any = None,
        resume_from_checkpoint: str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: Any = None,
    ) -> Any:
        """Trainer's loop, with the checkpoint it resumes from known to ``set_initial_training_values``
        (which Trainer calls before it reads the checkpoint)."""
        self._resuming_from = resume_from_checkpoint
        try:
            return super()._inner_training_loop(
                batch_size=batch_size,
                args=args,
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
            )
        finally:
            self._resuming_from = None

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        """Trainer's numbers, with enough epochs to reach ``max_steps`` from where a resumed loader
        stands. Trainer counts ``ceil(max_steps / steps_per_epoch)`` epochs from step 0 of this
        world; after a resume on another world (or per-device batch size) the steps already taken
        covered more or fewer windows than this world's steps do, and that count could end the run
        at the end of the resumed epoch, short of ``max_steps``. A surplus epoch is never started:
        Trainer stops at ``max_steps``."""
        values = super().set_initial_training_values(args, dataloader)
        resume, loader = self._resuming_from, self._stallfree_loader
        if args.max_steps <= 0 or resume is None or loader is None or dataloader is not loader:
            return values
        epochs, per_epoch = values[0], values[1]
        saved, _, where = self._saved_position(loader, resume)
        accumulate = args.gradient_accumulation_steps
        if where.finished:
            start, first = where.epoch + 1, per_epoch
        else:
            start, first = where.epoch, -(-where.batches_left // accumulate)
        after_first = max(0, args.max_steps - saved.step - first)
        needed = start + 1 + -(-after_first // per_epoch)
        return (needed, *values[1:]) if needed > epochs else values

    def _saved_position(
        self, loader: DataLoader, checkpoint: str
    ) -> tuple[state_file.SavedLoaders, dict[str, Any], loader_facts.EpochPosition]:
        """The checkpoint's loader state as this run resumes it (moved to its epoch's start under
        ``ignore_data_skip``, Trainer's meaning), and where it puts ``loader`` on this world."""
        saved = state_file.read(checkpoint)
        if len(saved.loaders) != 1:
            raise state_file.LoaderStateFileError(
                f"{len(saved.loaders)} loader states saved, the Trainer has one train loader",
                path=str(state_file.path_in(checkpoint)),
            )
        state = saved.loaders[0]
        where = loader_facts.position_after_restore(loader, state)
        if self.args.ignore_data_skip and not where.finished:  # the epoch starts over
            state = loader_facts.at_epoch_start(state)
            where = loader_facts.position_after_restore(loader, state)
        return saved, state, where

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """Trainer's state, then, when resuming, the loader's: the epoch and the batches of it
        already done come from where the restored loader stands on this world."""
        epochs, batches = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        loader = self._stallfree_loader
        if resume_from_checkpoint is None or loader is None:
            return epochs, batches
        saved, state, where = self._saved_position(loader, resume_from_checkpoint)
        if saved.step != self.state.global_step:
            raise state_file.LoaderStateFileError(
                f"loader state of step {saved.step} in a checkpoint of step {self.state.global_step}",
                path=str(state_file.path_in(resume_from_checkpoint)),
            )
        loader.load_state_dict(state)
        logger.info(
            "stallfree loader resumed at epoch %d, %d batches done, %d left on this rank (saved on %d processes)",
            where.epoch,
            where.batches_done,
            where.batches_left,
            saved.world_size,
        )
        epoch, done = (where.epoch + 1, 0) if where.finished else (where.epoch, where.batches_done)
        if self.args.max_steps <= 0:  # a length in epochs: count the steps left as this world has them
            accumulate = self.args.gradient_accumulation_steps
            left_now = -(-where.batches_left // accumulate) if not where.finished else 0
            later = max(0, num_train_epochs - where.epoch - 1) * num_update_steps_per_epoch
            self.state.max_steps = self.state.global_step + left_now + later
        return epoch, done

    # -- the training step ---------------------------------------------------------------------
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        return super().training_step(model, self._model_inputs(inputs), num_items_in_batch)

    def _model_inputs(self, inputs: Any) -> Any:
        """The batch without the fields ``model.forward`` does not take (``remove_unused_columns``)."""
        if not self.args.remove_unused_columns or not isinstance(inputs, Mapping):
            return inputs
        self._set_signature_columns_if_needed()
        keep = set(self._signature_columns)
        dropped = [k for k in inputs if k not in keep]
        if not dropped:
            return inputs
        if not self._dropped_logged:
            self._dropped_logged = True
            logger.info(
                "fields %s of the training batches are not arguments of %s.forward and are left out "
                "(remove_unused_columns=True)",
                ", ".join(map(str, dropped)),
                type(self.model).__name__,
            )
        return {k: v for k, v in inputs.items() if k in keep}
