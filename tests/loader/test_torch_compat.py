"""PyTorch DataLoader behaviours, run against stallfree.DataLoader.

Modelled on the behaviours PyTorch's own test_dataloader.py checks (samplers, batch samplers,
collate, drop_last, worker info, worker init, timeout, worker errors, iterable datasets with
workers, argument validation). Where torch's semantics are fully determined (no shuffle), the
batches are compared with torch's own DataLoader output; with shuffle, only the documented
properties are checked, since our loader draws its own seeded order.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from stallfree import DataLoader, get_worker_info

WORKERS = [0, 2]


class CountingDataset(tud.Dataset):
    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([i, i * 2]), i


class DictDataset(tud.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return {"x": np.full((2, 3), i, dtype=np.float32), "y": i, "name": f"s{i}"}


class ErrorDataset(tud.Dataset):
    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return i


class SlowDataset(tud.Dataset):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return i


class DyingDataset(tud.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        if i == 3:
            os._exit(7)
        return i


class WorkerInfoDataset(tud.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        info = get_worker_info()
        torch_info = tud.get_worker_info()
        assert (info is None) == (torch_info is None)
        if info is None:
            return torch.tensor([i, -1, -1])
        return torch.tensor([i, info.id, info.num_workers])


class RangeIterable(tud.IterableDataset):
    """Splits its range across workers with get_worker_info, as torch's docs recommend."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        info = tud.get_worker_info()
        if info is None:
            return iter(range(self.start, self.end))
        per = int(math.ceil((self.end - self.start) / info.num_workers))
        lo = self.start + info.id * per
        return iter(range(lo, min(lo + per, self.end)))


def _flatten(batches) -> list[int]:
    out: list[int] = []
    for b in batches:
        out.extend(int(v) for v in (b[1] if isinstance(b, list | tuple) else b))
    return out


def _assert_same_batches(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor)
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(b, dict):
            assert a.keys() == b.keys()
            _assert_same_batches(list(a.values()), list(b.values()))
        elif isinstance(b, list | tuple):
            assert type(a) is type(b)
            _assert_same_batches(list(a), list(b))
        else:
            assert a == b


# --- sequential batching: identical to torch --------------------------------------------------


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("batch_size,drop_last", [(1, False), (3, False), (3, True), (20, False), (7, True)])
def test_sequential_batches_match_torch(num_workers, batch_size, drop_last):
    ds = CountingDataset(20)
    ours = list(DataLoader(ds, batch_size=batch_size, drop_last=drop_last, num_workers=num_workers))
    theirs = list(tud.DataLoader(ds, batch_size=batch_size, drop_last=drop_last))
    _assert_same_batches(ours, theirs)


@pytest.mark.parametrize("batch_size,drop_last", [(3, False), (3, True), (4, True), (25, True)])
def test_len_matches_torch(batch_size, drop_last):
    ds = CountingDataset(20)
    assert len(DataLoader(ds, batch_size=batch_size, drop_last=drop_last)) == len(
        tud.DataLoader(ds, batch_size=batch_size, drop_last=drop_last)
    )


@pytest.mark.parametrize("num_workers", WORKERS)
def test_dict_numpy_and_string_samples_collate_like_torch(num_workers):
    ours = list(DataLoader(DictDataset(), batch_size=5, num_workers=num_workers))
    theirs = list(tud.DataLoader(DictDataset(), batch_size=5))
    _assert_same_batches(ours, theirs)
    assert ours[0]["x"].shape == (5, 2, 3)
    assert ours[-1]["name"] == ["s10", "s11"]


@pytest.mark.parametrize("num_workers", WORKERS)
def test_batch_size_none_yields_converted_samples(num_workers):
    ours = list(DataLoader(DictDataset(), batch_size=None, num_workers=num_workers))
    theirs = list(tud.DataLoader(DictDataset(), batch_size=None))
    _assert_same_batches(ours, theirs)
    assert isinstance(ours[3]["x"], torch.Tensor) and ours[3]["y"] == 3


@pytest.mark.parametrize("num_workers", WORKERS)
def test_custom_collate_fn(num_workers):
    loader = DataLoader(
        CountingDataset(10), batch_size=4, num_workers=num_workers, collate_fn=lambda b: [s[1] for s in b]
    )
    assert list(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# --- samplers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", WORKERS)
def test_custom_sampler_order_is_kept(num_workers):
    order = [9, 0, 8, 1, 7, 2]
    batches = list(DataLoader(CountingDataset(10), batch_size=2, sampler=order, num_workers=num_workers))
    assert _flatten(batches) == order


@pytest.mark.parametrize("num_workers", WORKERS)
def test_batch_sampler(num_workers):
    batch_sampler = [[1, 2], [7], [3, 4, 5]]
    batches = list(DataLoader(CountingDataset(10), batch_sampler=batch_sampler, num_workers=num_workers))
    assert [b[1].tolist() for b in batches] == batch_sampler
    assert len(DataLoader(CountingDataset(10), batch_sampler=batch_sampler)) == 3


@pytest.mark.parametrize("num_workers", WORKERS)
def test_torch_random_sampler_with_generator_is_reproducible(num_workers):
    def run():
        g = torch.Generator().manual_seed(123)
        sampler = tud.RandomSampler(CountingDataset(30), generator=g)
        return _flatten(
            DataLoader(CountingDataset(30), batch_size=4, sampler=sampler, num_workers=num_workers)
        )

    first = run()
    assert sorted(first) == list(range(30))
    assert first == run()
    g = torch.Generator().manual_seed(123)
    assert first == list(tud.RandomSampler(CountingDataset(30), generator=g))


@pytest.mark.parametrize("num_workers", WORKERS)
def test_shuffle_covers_every_sample_once_and_reshuffles_each_epoch(num_workers):
    loader = DataLoader(CountingDataset(40), batch_size=6, shuffle=True, num_workers=num_workers)
    epoch1 = _flatten(loader)
    epoch2 = _flatten(loader)
    assert sorted(epoch1) == sorted(epoch2) == list(range(40))
    assert epoch1 != epoch2


def test_shuffle_with_same_generator_seed_is_reproducible():
    def run():
        return _flatten(
            DataLoader(
                CountingDataset(40), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(7)
            )
        )

    assert run() == run()


def test_shuffle_drop_last_drops_only_the_partial_batch():
    batches = list(DataLoader(CountingDataset(23), batch_size=5, shuffle=True, drop_last=True))
    assert len(batches) == 4 and all(len(b[1]) == 5 for b in batches)
    assert len(set(_flatten(batches))) == 20


# --- argument validation, as torch ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"sampler": [0, 1], "shuffle": True}, "sampler option is mutually exclusive with shuffle"),
        ({"batch_sampler": [[0]], "batch_size": 2}, "batch_sampler option is mutually exclusive"),
        ({"batch_sampler": [[0]], "shuffle": True}, "batch_sampler option is mutually exclusive"),
        ({"batch_sampler": [[0]], "drop_last": True}, "batch_sampler option is mutually exclusive"),
        ({"batch_size": None, "drop_last": True}, "batch_size=None option disables auto-batching"),
        ({"num_workers": -1}, "num_workers option should be non-negative"),
        ({"timeout": -1}, "timeout option should be non-negative"),
        ({"prefetch_factor": 2}, "prefetch_factor option could only be specified in multiprocessing"),
        ({"persistent_workers": True}, "persistent_workers option needs num_workers > 0"),
    ],
)
def test_invalid_arguments_raise_like_torch(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tud.DataLoader(CountingDataset(4), **kwargs)
    with pytest.raises(ValueError, match=message):
        DataLoader(CountingDataset(4), **kwargs)


def test_iterable_dataset_rejects_sampler_and_shuffle():
    with pytest.raises(ValueError, match="sampler"):
        DataLoader(RangeIterable(0, 4), sampler=[0, 1])
    with pytest.raises(ValueError, match="shuffle"):
        DataLoader(RangeIterable(0, 4), shuffle=True)


# --- workers ----------------------------------------------------------------------------------


def test_get_worker_info_is_none_in_main_process():
    assert get_worker_info() is None
    batches = list(DataLoader(WorkerInfoDataset(), batch_size=4))
    assert torch.equal(batches[0][:, 1], torch.tensor([-1, -1, -1, -1]))


def test_get_worker_info_inside_workers():
    batches = list(DataLoader(WorkerInfoDataset(), batch_size=2, num_workers=2))
    rows = torch.cat(batches)
    assert rows[:, 0].tolist() == list(range(8))
    assert set(rows[:, 1].tolist()) == {0, 1}
    assert set(rows[:, 2].tolist()) == {2}


def _init_fn(worker_id: int) -> None:
    info = tud.get_worker_info()
    info.dataset.init_worker_id = worker_id  # type: ignore[union-attr]


class InitCheckDataset(tud.Dataset):
    init_worker_id = -1

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return self.init_worker_id


def test_worker_init_fn_runs_in_each_worker():
    values = _flatten_plain(
        DataLoader(InitCheckDataset(), batch_size=1, num_workers=2, worker_init_fn=_init_fn)
    )
    assert set(values) == {0, 1}


def _flatten_plain(batches) -> list[int]:
    return [int(v) for b in batches for v in b]


class SeedDataset(tud.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return torch.initial_seed()


def test_workers_get_distinct_seeds_and_base_seed_from_generator():
    seeds = _flatten_plain(DataLoader(SeedDataset(), batch_size=1, num_workers=2))
    assert len(set(seeds)) == 2

    def with_generator():
        g = torch.Generator().manual_seed(42)
        return _flatten_plain(DataLoader(SeedDataset(), batch_size=1, num_workers=2, generator=g))

    assert with_generator() == with_generator()


@pytest.mark.parametrize("num_workers", WORKERS)
def test_error_in_dataset_is_reraised_with_its_type(num_workers):
    loader = DataLoader(ErrorDataset(bad=5), batch_size=2, num_workers=num_workers)
    with pytest.raises(ValueError, match="bad sample 5"):
        list(loader)


def test_worker_error_message_names_the_worker():
    loader = DataLoader(ErrorDataset(bad=5), batch_size=2, num_workers=2)
    with pytest.raises(ValueError) as info:
        list(loader)
    assert "worker" in str(info.value).lower()


def test_timeout_raises_instead_of_hanging():
    loader = DataLoader(SlowDataset(delay=2.0), batch_size=1, num_workers=1, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        next(iter(loader))
    assert time.monotonic() - t0 < 30  # a hang would hit pytest-timeout instead


def test_dead_worker_is_reported_not_hung():
    loader = DataLoader(DyingDataset(), batch_size=1, num_workers=2, timeout=0)
    with pytest.raises(RuntimeError, match="(?i)worker"):
        list(loader)


@pytest.mark.parametrize("num_workers", [2, 3])
def test_iterable_dataset_split_by_worker_info_yields_each_item_once(num_workers):
    values = _flatten_plain(DataLoader(RangeIterable(0, 20), batch_size=3, num_workers=num_workers))
    assert sorted(values) == list(range(20))


def test_iterable_dataset_without_split_is_replicated_per_worker_as_in_torch():
    class Plain(tud.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    ours = sorted(_flatten_plain(DataLoader(Plain(), batch_size=1, num_workers=2)))
    theirs = sorted(_flatten_plain(tud.DataLoader(Plain(), batch_size=1, num_workers=2)))
    assert ours == theirs == sorted(list(range(5)) * 2)


def test_persistent_workers_run_init_once_across_epochs(tmp_path):
    marker = tmp_path / "inits"

    def init(worker_id: int) -> None:
        with open(marker, "a") as f:
            f.write(f"{worker_id}\n")

    loader = DataLoader(
        CountingDataset(8), batch_size=2, num_workers=2, persistent_workers=True, worker_init_fn=init
    )
    for _ in range(3):
        assert sorted(_flatten(loader)) == list(range(8))
    assert sorted(marker.read_text().split()) == ["0", "1"]


def test_spawn_multiprocessing_context():
    loader = DataLoader(CountingDataset(6), batch_size=2, num_workers=2, multiprocessing_context="spawn")
    assert _flatten(loader) == list(range(6))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_pin_memory_without_cuda_still_yields_batches():
    with pytest.warns(UserWarning):
        batches = list(DataLoader(CountingDataset(6), batch_size=3, pin_memory=True))
    assert _flatten(batches) == list(range(6))


def test_break_out_of_iteration_then_iterate_again():
    loader = DataLoader(CountingDataset(20), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    del it
    assert _flatten(loader) == list(range(20))
