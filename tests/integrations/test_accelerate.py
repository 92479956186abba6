"""Our Accelerator in one process: ``prepare`` hands our loader back as it is, and ``save_state``
/ ``load_state`` alone resume it exactly (JSON, nothing pickled). The multi-process kill and
resume runs in tests/examples/test_accelerate.py."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import stallfree
from stallfree.integrations.state_file import LoaderStateFileError, MissingLoaderStateError

# accelerate is imported by the tests that run, not at collection: every xdist worker collects
# this file, one runs its tests (importing accelerate costs a process about a CPU-second)
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed"),
    pytest.mark.xdist_group("accelerate_in_process"),
]

N = 40


@pytest.fixture
def accelerator_cls() -> type:
    """Our Accelerator class (``stallfree.integrations.accelerate.Accelerator``)."""
    from stallfree.integrations.accelerate import Accelerator

    return Accelerator


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def with_image(i: int) -> dict:
    """A per-sample ``decode=``: the field the training loop needs exists only through it."""
    return {"index": i, "image": torch.full((2,), float(i))}


def make_loader() -> stallfree.DataLoader:
    return stallfree.DataLoader(Numbers(), batch_size=4, shuffle=True, seed=7, decode=with_image)


def indices(batches) -> list[int]:
    return [i for b in batches for i in b["index"].tolist()]


def test_prepare_returns_our_loader_as_it_is(accelerator_cls):
    accelerator = accelerator_cls(cpu=True)
    model = torch.nn.Linear(2, 1)
    loader = make_loader()
    model, optim, prepared = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    assert prepared is loader and accelerator.stallfree_loaders == (loader,)
    batch = next(iter(prepared))
    assert batch["image"].shape == (4, 2)  # decode= ran: stock accelerate rebuilds the loader without it
    assert prepared.stats()["batches"] == 1
    assert accelerator.prepare(loader) is loader and accelerator.stallfree_loaders == (loader,)  # once
    assert accelerator.skip_first_batches(loader, 3) is loader  # load_state resumes it; no second skip


def test_save_state_and_load_state_resume_mid_epoch_exactly(tmp_path, accelerator_cls):
    accelerator = accelerator_cls(cpu=True)
    loader = accelerator.prepare(make_loader())
    it = iter(loader)
    before = indices(next(it) for _ in range(3))
    accelerator.save_state(str(tmp_path / "ckpt"))
    indices(it)  # the rest of the killed run, never checkpointed

    saved = json.loads((tmp_path / "ckpt" / "stallfree_loader_state.json").read_text())
    assert [(s["epoch"], s["consumed"]) for s in saved["loaders"]] == [(0, 12)]
    assert not list((tmp_path / "ckpt").glob("custom_checkpoint_*"))  # not pickled through accelerate

    again = accelerator_cls(cpu=True)
    resumed = again.prepare(make_loader())
    again.load_state(str(tmp_path / "ckpt"))
    resumed.set_epoch(0)  # what a training loop does at the top of the resumed epoch
    after = indices(resumed)
    assert sorted(before + after) == list(range(N))
    resumed.set_epoch(1)
    assert sorted(indices(resumed)) == list(range(N))


def test_a_state_loaded_before_its_loader_is_prepared_waits_for_it(tmp_path, accelerator_cls):
    accelerator = accelerator_cls(cpu=True)
    loader = accelerator.prepare(make_loader())
    it = iter(loader)
    before = indices([next(it)])
    accelerator.save_state(str(tmp_path / "ckpt"))

    again = accelerator_cls(cpu=True)
    again.load_state(str(tmp_path / "ckpt"))
    resumed = again.prepare(make_loader())
    assert sorted(before + indices(resumed)) == list(range(N))


def test_a_checkpoint_without_the_loader_state_is_refused_when_a_loader_needs_it(tmp_path, accelerator_cls):
    accelerator_cls(cpu=True).save_state(str(tmp_path / "plain"))  # no loader of ours: no file, no error
    accelerator_cls(cpu=True).load_state(str(tmp_path / "plain"))
    accelerator = accelerator_cls(cpu=True)
    accelerator.prepare(make_loader())
    with pytest.raises(MissingLoaderStateError) as info:
        accelerator.load_state(str(tmp_path / "plain"))
    assert info.value.path == str(tmp_path / "plain" / "stallfree_loader_state.json")


def test_a_checkpoint_without_the_loader_state_loaded_before_prepare_is_refused_there(
    tmp_path, accelerator_cls
):
    """The same checkpoint, loaded before the loader is prepared (the order the docs allow): the
    loader used to start its epoch over in silence; its prepare now raises as load_state would."""
    accelerator_cls(cpu=True).save_state(str(tmp_path / "plain"))
    accelerator = accelerator_cls(cpu=True)
    accelerator.load_state(str(tmp_path / "plain"))
    with pytest.raises(MissingLoaderStateError) as info:
        accelerator.prepare(make_loader())
    assert info.value.path == str(tmp_path / "plain" / "stallfree_loader_state.json")
    accelerator.free_memory()  # forgets what was loaded, as it forgets the prepared loaders
    assert isinstance(accelerator.prepare(make_loader()), stallfree.DataLoader)


def test_more_loaders_than_saved_states_is_an_error_naming_the_file(tmp_path, accelerator_cls):
    one = accelerator_cls(cpu=True)
    one.prepare(make_loader())
    one.save_state(str(tmp_path / "ckpt"))
    two = accelerator_cls(cpu=True)
    two.prepare(make_loader(), make_loader())
    with pytest.raises(LoaderStateFileError, match="1 loader states saved, 2 stallfree loaders prepared"):
        two.load_state(str(tmp_path / "ckpt"))


def test_split_batches_is_refused_for_our_loader(accelerator_cls):
    from accelerate.utils import DataLoaderConfiguration

    accelerator = accelerator_cls(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    with pytest.raises(ValueError, match="batch_size is per process"):
        accelerator.prepare(make_loader())
    plain = torch.utils.data.DataLoader(Numbers(), batch_size=4)
    assert type(accelerator.prepare(plain)).__module__.startswith("accelerate")  # others: accelerate's own


def test_on_a_gpu_a_loader_that_leaves_batches_on_the_cpu_is_refused_with_the_fix(accelerator_cls):
    class OnGpu(accelerator_cls):
        device = torch.device("cuda", 0)  # what accelerate reports on a GPU machine

    accelerator = OnGpu(cpu=True)
    with pytest.raises(
        ValueError, match=r"build it with device=accelerator.device .* device_placement=False"
    ):
        accelerator.prepare(make_loader())
    loader = make_loader()
    assert accelerator.prepare(loader, device_placement=[False]) is loader  # the user moves batches


def test_an_evaluation_loader_in_index_order_is_ours_too(accelerator_cls):
    accelerator = accelerator_cls(cpu=True)
    loader = stallfree.DataLoader(Numbers(), batch_size=4, shuffle=False, seed=0, decode=with_image)
    assert accelerator.prepare(loader) is loader
    assert indices(loader) == list(range(N))
    with pytest.raises(ValueError, match="in index order with shuffle=False"):
        accelerator.prepare(stallfree.DataLoader(Numbers(), batch_size=4, shuffle=False))
