"""Batched fetches: a dataset's collated ``get_batch`` (one call and one slot write per field per
batch) gives exactly what the per-sample path gives, and torch's ``__getitems__`` hook is called
as torch's DataLoader calls it."""

from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud

import stallfree
from stallfree.tokens.packing import TokenDataset
from tests.tokens.helpers import random_docs, write_megatron

FIELDS = ("input_ids", "labels", "position_ids", "doc_ids")


class PerSample:
    """A TokenDataset without ``get_batch``: the loader reads and collates it sample by sample."""

    def __init__(self, ds: TokenDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        return self.ds[i]

    def get_many(self, indices: list[int]) -> list[dict]:
        return self.ds.get_many(indices)


class OnlyBatched(TokenDataset):
    """Batches only come from ``get_batch``: a per-sample read would fail every sample."""

    def __getitem__(self, i: int) -> dict:
        raise AssertionError(f"per-sample read of {i}")

    def get_many(self, indices: list[int]) -> list[dict]:
        raise AssertionError(f"per-sample read of {indices}")


class CountingBatched(TokenDataset):
    """Counts ``get_batch`` calls in this process (the in-process worker shares it)."""

    calls = 0

    def get_batch(self, indices: list[int]) -> dict:
        CountingBatched.calls += 1
        return super().get_batch(indices)


class BatchFails(TokenDataset):
    """``get_batch`` fails for any batch holding window 5; window 5 alone fails too."""

    def get_batch(self, indices: list[int]) -> dict:
        if 5 in indices:
            raise OSError("batch read failed")
        return super().get_batch(indices)

    def get_many(self, indices: list[int]) -> list[dict]:
        if 5 in indices:
            raise ValueError("bad window 5")
        return super().get_many(indices)


class BatchFailsPerSample(PerSample):
    def get_many(self, indices: list[int]) -> list[dict]:
        if 5 in indices:
            raise ValueError("bad window 5")
        return super().get_many(indices)


@pytest.fixture(params=[None, 9], ids=["no-eos", "eos"])
def tokens(tmp_path, request):
    docs = random_docs(3, n=80, max_len=30)
    write_megatron(tmp_path / "c", docs, "int32")
    return str(tmp_path / "c"), request.param


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert list(x) == list(y) == list(FIELDS)
        for k in FIELDS:
            assert x[k].dtype == y[k].dtype == torch.int64
            assert x[k].shape == y[k].shape
            assert torch.equal(x[k], y[k]), k


def _loader(ds, **kw) -> stallfree.DataLoader:
    return stallfree.DataLoader(ds, **{"batch_size": 5, "num_workers": 2, **kw})


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kw", [{"shuffle": True, "seed": 4}, {"shuffle": False}], ids=["fast", "sampler"])
def test_collated_batches_equal_the_per_sample_path(tokens, num_workers, drop_last, kw):
    src, eos = tokens
    ds = TokenDataset(src, 7, eos=eos)
    assert len(ds) % 5  # a last partial batch
    got = list(_loader(ds, num_workers=num_workers, drop_last=drop_last, **kw))
    want = list(_loader(PerSample(ds), num_workers=num_workers, drop_last=drop_last, **kw))
    _same(got, want)
    assert len(got) == (len(ds) // 5 if drop_last else -(-len(ds) // 5))
    assert got[-1]["input_ids"].shape[0] == (5 if drop_last else len(ds) % 5)
    torch_order = (
        list(tud.DataLoader(PerSample(ds), batch_size=5, drop_last=drop_last)) if not kw["shuffle"] else None
    )
    if torch_order is not None:
        _same(got, torch_order)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_fast_path_reads_only_through_get_batch(tokens, num_workers):
    src, eos = tokens
    ds, ref = OnlyBatched(src, 6, eos=eos), TokenDataset(src, 6, eos=eos)
    for epoch in range(2):
        got = list(
            _loader(ds, num_workers=num_workers, shuffle=True, seed=1, persistent_workers=num_workers > 0)
        )
        _same(got, list(_loader(PerSample(ref), num_workers=num_workers, shuffle=True, seed=1)))
        assert epoch == 0 or got  # two epochs over persistent workers


def test_resume_mid_epoch_on_the_fast_path(tokens):
    src, eos = tokens
    ds = TokenDataset(src, 5, eos=eos)
    whole = list(_loader(PerSample(ds), shuffle=True, seed=7))
    first = _loader(ds, shuffle=True, seed=7)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it
    again = _loader(ds, shuffle=True, seed=7, num_workers=1)
    again.load_state_dict(state)
    _same(head + list(again), whole)


def test_get_batch_only_where_default_collate_follows_the_read(tokens):
    src, eos = tokens
    ds = CountingBatched(src, 6, eos=eos)
    CountingBatched.calls = 0
    batches = list(_loader(ds, num_workers=0, shuffle=True, seed=0))
    assert CountingBatched.calls == len(batches)
    CountingBatched.calls = 0
    kept = list(_loader(ds, num_workers=0, shuffle=True, seed=0, collate_fn=lambda b: b))
    mapped = list(_loader(ds, num_workers=0, shuffle=True, seed=0, decode=lambda s: s))
    single = list(_loader(ds, num_workers=0, batch_size=None))
    assert CountingBatched.calls == 0  # a collate_fn, a per-sample decode, batch_size=None: per sample
    assert [len(b) for b in kept] == [len(b["input_ids"]) for b in batches]
    _same(mapped, batches)
    assert len(single) == len(ds) and single[0]["input_ids"].shape == (6,)


class Unrelated(tud.Dataset):
    """A torch Dataset whose ``get_batch`` means something else: never called by the loader."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((3,), i)}

    def get_batch(self, split: str) -> None:
        raise AssertionError("not a loader hook")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_unrelated_get_batch_is_not_called(num_workers):
    got = list(stallfree.DataLoader(Unrelated(), batch_size=4, num_workers=num_workers))
    want = list(tud.DataLoader(Unrelated(), batch_size=4))
    assert [b["x"].tolist() for b in got] == [b["x"].tolist() for b in want]


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_failing_get_batch_is_read_again_per_sample(tokens, on_error):
    src, eos = tokens
    ds = BatchFails(src, 6, eos=eos)
    ref = BatchFailsPerSample(TokenDataset(src, 6, eos=eos))
    if on_error == "raise":
        for d in (ds, ref):
            with pytest.raises(ValueError, match="bad window 5"):
                list(_loader(d, shuffle=False, on_error=on_error))
        return
    got_l, want_l = (
        _loader(ds, shuffle=False, on_error=on_error),
        _loader(ref, shuffle=False, on_error=on_error),
    )
    got, want = list(got_l), list(want_l)
    _same(got, want)
    assert sum(len(b["input_ids"]) for b in got) == len(ds) - 1
    assert got_l.stats()["failed_keys"] == want_l.stats()["failed_keys"] == ["index 5"]


# -- torch's __getitems__ -------------------------------------------------------------------------
class GetItems(tud.Dataset):
    """Defines ``__getitems__`` (and a ``__getitem__`` that must not be called alongside it)."""

    def __init__(self, n: int = 11, log: str | None = None) -> None:
        self.n, self.log = n, log

    def _note(self, what: str) -> None:
        if self.log is not None:
            with open(self.log, "a") as f:  # one short O_APPEND write per call: whole lines
                f.write(what + "\n")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self._note(f"item {i}")
        return {"i": i, "x": torch.full((4,), float(i))}

    def __getitems__(self, indices: list[int]) -> list[dict]:
        self._note(f"items {list(indices)}")
        return [{"i": i, "x": torch.full((4,), float(i)), "from": "getitems"} for i in indices]


class GetItemsOff(GetItems):
    __getitems__ = None  # torch tests the attribute's truth: this turns the hook off


class GetItemsFails(GetItems):
    def __getitems__(self, indices: list[int]) -> list[dict]:
        raise KeyError(f"no batch {indices}")


def _calls(log) -> list[str]:
    with open(log) as f:
        return sorted(f.read().splitlines())


def _collate_record(batch):
    """A collate_fn showing what it was handed: the list from __getitems__, as it came."""
    return {
        "type": type(batch).__name__,
        "len": len(batch),
        "from": [s.get("from") for s in batch],
        "i": [s["i"] for s in batch],
    }


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cls", [GetItems, GetItemsOff], ids=["getitems", "off"])
@pytest.mark.parametrize(
    "kw",
    [
        {"batch_size": 4},
        {"batch_size": 4, "drop_last": True},
        {"batch_size": 4, "collate_fn": _collate_record},
        {"batch_size": None},
    ],
    ids=["default", "drop_last", "collate_fn", "no-batching"],
)
def test_getitems_is_called_as_torch_calls_it(tmp_path, num_workers, cls, kw):
    ours_log, torch_log = str(tmp_path / "ours"), str(tmp_path / "torch")
    ours = list(stallfree.DataLoader(cls(log=ours_log), num_workers=num_workers, **kw))
    theirs = list(tud.DataLoader(cls(log=torch_log), num_workers=num_workers, **kw))
    assert repr(ours) == repr(theirs)
    assert _calls(ours_log) == _calls(torch_log)
    assert any(line.startswith("items") for line in _calls(ours_log)) == (
        cls is GetItems and kw["batch_size"] is not None
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_getitems_raises_its_error_as_in_torch(num_workers):
    with pytest.raises(KeyError, match="no batch") as ours:
        list(stallfree.DataLoader(GetItemsFails(), batch_size=4, num_workers=num_workers))
    with pytest.raises(KeyError, match="no batch") as theirs:
        list(tud.DataLoader(GetItemsFails(), batch_size=4, num_workers=num_workers))
    assert type(ours.value) is type(theirs.value)
