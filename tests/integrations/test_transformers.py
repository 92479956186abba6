"""Our Trainer in one process: the train loader is ours, built from TrainingArguments; every
checkpoint holds its state; a resume goes on exactly where the checkpoint stood. The kill and
resume on two and one processes runs in tests/examples/test_hf_trainer.py."""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

import stallfree
from stallfree.integrations.state_file import MissingLoaderStateError

if TYPE_CHECKING:
    import transformers

# Every test here runs on one xdist worker: importing our Trainer (transformers' Trainer and what
# it imports) costs about 4.6 CPU-s a process, so it happens on first use (trainer_classes), once;
# transformers itself (~0.5 CPU-s) is imported where it is used, not by every worker's collection.
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
    ),
    pytest.mark.xdist_group("transformers_trainer"),
]

WINDOWS, SEQ = 24, 8


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(WINDOWS * SEQ + 1, dtype=np.uint16).tofile(path)
    return path


def tiny_model() -> transformers.LlamaForCausalLM:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=WINDOWS * SEQ + 8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@functools.cache
def trainer_classes() -> SimpleNamespace:
    """Our Trainer and this file's subclasses, made on first use rather than at collection."""
    import transformers

    from stallfree.integrations.transformers import Trainer

    class Recording(Trainer):
        """Records the window ids of every training step (a window's first token // SEQ)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.windows: list[int] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.windows += (inputs["input_ids"][:, 0] // SEQ).tolist()
            return super().training_step(model, inputs, num_items_in_batch)

    class StopAt(transformers.TrainerCallback):
        """Ends training right after the checkpoint of ``step``, as a preempted job would."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == self.step:
                control.should_training_stop = True

    return SimpleNamespace(Trainer=Trainer, Recording=Recording, StopAt=StopAt)


def make_trainer(
    tokens, out, *, stop_at=None, data_collator=None, train_dataset=None, compute_loss_func=None, **args
):
    import transformers

    classes = trainer_classes()
    dataset = train_dataset or stallfree.TokenDataset(str(tokens), SEQ, dtype="uint16", labels="inputs")
    training = transformers.TrainingArguments(**{
        "output_dir": str(out), "per_device_train_batch_size": 4, "num_train_epochs": 2,
        "save_strategy": "steps", "save_steps": 2, "report_to": "none", "use_cpu": True, "seed": 3,
        "dataloader_num_workers": 0, **args,
    })  # fmt: skip
    callbacks = [classes.StopAt(stop_at)] if stop_at else []
    return classes.Recording(
        model=tiny_model(), args=training, train_dataset=dataset, callbacks=callbacks,
        data_collator=data_collator, compute_loss_func=compute_loss_func,
    )  # fmt: skip


def test_the_train_loader_is_ours_built_from_the_training_arguments(tokens, tmp_path):
    trainer = make_trainer(tokens, tmp_path / "out", dataloader_drop_last=True, data_seed=11)
    loader = trainer.get_train_dataloader()
    assert isinstance(loader, stallfree.DataLoader) and loader is trainer.train_loader
    assert (loader.mode, loader.batch_size, loader.drop_last, loader.seed) == ("fast", 4, True, 11)
    assert trainer.get_train_dataloader() is loader  # built once
    assert trainer.get_resumed_dataloader(loader, 3) is loader  # its state resumes it: no batch skipping
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels", "position_ids", "doc_ids"}
    # what forward does not take is left out, as Trainer's collator wrapper does for its own loader
    assert set(trainer._model_inputs(batch)) == {"input_ids", "labels", "position_ids"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "accumulate, stop_at, last_step, stood",
    [
        (2, 4, 6, (1, 8)),  # 6 batches an epoch, 2 a step: stops 2 batches into the second epoch
        (1, 6, 12, (1, 0)),  # at the end of the first epoch: the second, at its start
    ],
)
def test_a_stopped_run_resumes_from_its_checkpoint_with_every_window_once_per_epoch(
    tokens, tmp_path, accumulate, stop_at, last_step, stood
):
    out = tmp_path / "out"
    first = make_trainer(tokens, out, stop_at=stop_at, gradient_accumulation_steps=accumulate)
    first.train()
    assert first.state.global_step == stop_at
    saved = json.loads((out / f"checkpoint-{stop_at}" / "stallfree_loader_state.json").read_text())
    assert (saved["step"], saved["loaders"][0]["epoch"], saved["loaders"][0]["consumed"]) == (stop_at, *stood)
    second = make_trainer(tokens, out, gradient_accumulation_steps=accumulate)
    second.train(resume_from_checkpoint=str(out / f"checkpoint-{stop_at}"))
    assert second.state.global_step == last_step
    trained = collections.Counter(first.windows + second.windows)
    assert trained == collections.Counter({w: 2 for w in range(WINDOWS)})

    # ignore_data_skip: Trainer's meaning, the resumed epoch starts over (same order)
    third = make_trainer(tokens, out, ignore_data_skip=True, gradient_accumulation_steps=accumulate)
    third.train(resume_from_checkpoint=str(out / f"checkpoint-{stop_at}"))
    assert sorted(third.windows) == list(range(WINDOWS))
    assert third.windows == first.windows[6 * 4 :] + second.windows


def test_max_steps_is_reached_when_the_resumed_run_takes_fewer_windows_a_step(tokens, tmp_path):
    """A resume on fewer processes (here: a smaller per-device batch, which moves the same
    arithmetic in one process) has more steps per epoch than the saved run; Trainer's epoch count
    for max_steps, worked out from step 0 in the new world, then ended the run at the end of the
    resumed epoch, a step short of max_steps."""
    out = tmp_path / "out"
    # 8 windows a step: 3 steps an epoch; stopped after step 2 (16 of 24 windows)
    first = make_trainer(tokens, out, stop_at=2, max_steps=5, per_device_train_batch_size=8)
    first.train()
    assert first.state.global_step == 2
    # 4 windows a step: 6 steps an epoch. Trainer counts ceil(5 / 6) = 1 epoch, but the resumed
    # epoch has 2 steps left (3, 4), so step 5 is the first of the next epoch
    second = make_trainer(tokens, out, max_steps=5)
    second.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert second.state.global_step == 5
    assert sorted(first.windows + second.windows[:8]) == list(range(WINDOWS))  # epoch 1, once each
    assert len(second.windows) == 12 and len(set(second.windows[8:])) == 4  # step 5: 4 of epoch 2


def test_shifted_labels_for_a_model_that_shifts_them_again_are_refused(tokens, tmp_path):
    """TokenDataset's default labels are already shifted; a Hugging Face causal LM shifts them
    again and learns token t+2 with a falling loss. The Trainer sees both and says so."""
    import transformers

    shifted = stallfree.TokenDataset(str(tokens), SEQ, dtype="uint16")  # labels="shifted"
    trainer = make_trainer(tokens, tmp_path / "a")
    trainer.train_dataset = shifted
    with pytest.raises(
        ValueError, match=r"labels='shifted'.*LlamaForCausalLM shifts them again.*labels='inputs'"
    ):
        trainer.get_train_dataloader()
    # evaluation too (Trainer's own loader), for one eval dataset or a dict of them
    trainer.train_dataset = make_trainer(tokens, tmp_path / "a").train_dataset
    with pytest.raises(ValueError, match=r"eval_dataset gives labels='shifted'"):
        trainer.evaluate(eval_dataset={"held": shifted})
    # a collator that makes labels from input_ids, or a loss of your own, is left to you
    lm = transformers.DataCollatorForLanguageModeling(tokenizer=None, mlm=False)
    assert make_trainer(
        tokens, tmp_path / "b", data_collator=lm, train_dataset=shifted
    ).get_train_dataloader()
    own = make_trainer(
        tokens, tmp_path / "c", compute_loss_func=lambda out, labels, num_items_in_batch=None: 0
    )
    own.train_dataset = shifted
    assert own.get_train_dataloader() is not None


def test_a_checkpoint_without_the_loader_state_is_refused(tokens, tmp_path):
    out = tmp_path / "out"
    make_trainer(tokens, out, stop_at=2).train()
    (out / "checkpoint-2" / "stallfree_loader_state.json").unlink()
    with pytest.raises(MissingLoaderStateError, match="saved without stallfree.integrations"):
        make_trainer(tokens, out).train(resume_from_checkpoint=str(out / "checkpoint-2"))


def test_options_trainer_arguments_decide_are_refused_with_the_argument_to_use(tokens, tmp_path):
    import transformers

    told = r"batch_size \(TrainingArguments.per_device_train_batch_size\), collate_fn \(Trainer's data_collator\)"
    with pytest.raises(ValueError, match=told):
        trainer_classes().Trainer(
            model=tiny_model(),
            args=transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
            train_dataset=stallfree.TokenDataset(str(tokens), SEQ, dtype="uint16"),
            loader_options={"batch_size": 8, "decode": None, "collate_fn": None},
        )


def test_samplers_of_trainer_and_iterable_datasets_are_refused(tokens, tmp_path):
    trainer = make_trainer(tokens, tmp_path / "a", train_sampling_strategy="group_by_length")
    with pytest.raises(
        ValueError, match="'random' \\(our seeded shuffle, or the order= of loader_options\\)"
    ):
        trainer.get_train_dataloader()

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    trainer = make_trainer(tokens, tmp_path / "b")
    trainer.train_dataset = Stream()
    with pytest.raises(TypeError, match="needs a map-style train_dataset"):
        trainer.get_train_dataloader()
