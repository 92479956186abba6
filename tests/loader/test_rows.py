"""Collate-while-decoding (loader/shm/rows.py): the batch equals torch's default_collate of the same
decoded samples, rows close up over skipped samples, odd samples fall back to torch's own rules."""

from __future__ import annotations

import gc
import weakref
from collections import namedtuple

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from stallfree.loader.dataloader import DataLoader
from stallfree.loader.shm import rows
from stallfree.loader.shm import storage as shm
from tests.loader.helpers import Numbers

Pair = namedtuple("Pair", ["a", "b"])


def rich(sample: dict) -> dict:
    """A decode whose output has tensors at several depths, plus numbers, strings and numpy."""
    i = sample["i"]
    return {
        "i": i,
        "img": torch.arange(12, dtype=torch.float32).reshape(3, 4) + i,
        "nested": {"mask": torch.full((5,), i % 2 == 0), "ids": [torch.tensor([i, -i]), i * 2]},
        "pair": Pair(torch.tensor(float(i)).to(torch.float16), f"s{i}"),
        "np": np.full((2,), i, dtype=np.int32),
    }


def expected(batch_indices: list[int]) -> object:
    return tud.default_collate([rich(Numbers(64)[i]) for i in batch_indices])


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_batches_equal_torch_default_collate(threads):
    dl = DataLoader(
        Numbers(64), batch_size=8, shuffle=True, seed=3, num_workers=2, decode=rich, decode_threads=threads
    )
    seen = []
    for batch in dl:
        order = batch["i"].tolist()
        assert_same(batch, expected(order))
        seen += order
    assert sorted(seen) == list(range(64))


class _Skips:
    def __call__(self, sample: dict) -> dict:
        if sample["i"] % 3 == 1:
            raise ValueError(f"bad {sample['i']}")
        return rich(sample)


def test_rows_close_up_over_skipped_samples():
    dl = DataLoader(
        Numbers(30), batch_size=6, shuffle=True, seed=0, num_workers=2, decode=_Skips(), on_error="skip"
    )
    seen = []
    for batch in dl:
        order = batch["i"].tolist()
        assert all(i % 3 != 1 for i in order)
        assert_same(batch, expected(order))
        seen += order
    assert sorted(seen) == [i for i in range(30) if i % 3 != 1]


def ragged(sample: dict) -> dict:
    return {"i": sample["i"], "x": torch.zeros(3 if sample["i"] != 5 else 4)}


def test_a_sample_of_another_shape_gets_torchs_own_collate_error():
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        list(DataLoader(Numbers(8), batch_size=8, shuffle=True, seed=0, num_workers=1, decode=ragged))


def renamed(sample: dict) -> dict:
    key = "x" if sample["i"] != 3 else "y"
    return {"i": sample["i"], key: torch.ones(2)}


def test_a_sample_of_another_structure_behaves_as_default_collate():
    samples = [renamed(Numbers(8)[i]) for i in range(8)]
    with pytest.raises(KeyError) as want:
        tud.default_collate(samples)
    with pytest.raises(KeyError) as got:
        list(DataLoader(Numbers(8), batch_size=8, shuffle=False, seed=None, num_workers=1, decode=renamed))
    assert f"KeyError: {want.value}" in str(got.value)  # torch's wording: the worker's traceback


def test_writer_frees_each_samples_tensor_and_never_mutates_it():
    storage = torch.UntypedStorage._new_shared(1 << 20)
    writer = rows.RowWriter(2, lambda nbytes: storage, min_row_bytes=0)
    kept = {"x": torch.arange(4.0), "label": 1}  # a decode may return objects it keeps
    out = writer.put(1, kept)
    assert torch.equal(kept["x"], torch.arange(4.0)) and isinstance(out["x"], rows.Row)
    fresh = {"x": torch.full((4,), 7.0), "label": 0}
    ref = weakref.ref(fresh["x"])
    out0 = writer.put(0, fresh)
    del fresh
    gc.collect()
    assert ref() is None  # only the row holds the data now
    assert isinstance(out0["x"], rows.Row)
    got = shm.default_collate_into([out0, out], writer.arena, writer.collate_map([0, 1]))
    assert torch.equal(got["x"], torch.tensor([[7.0] * 4, [0.0, 1.0, 2.0, 3.0]]))
    assert got["label"].tolist() == [0, 1]
    assert got["x"].untyped_storage().data_ptr() == storage.data_ptr()  # in the slot, no copy


def test_writer_hands_rows_back_when_a_later_sample_differs():
    storage = torch.UntypedStorage._new_shared(1 << 20)
    writer = rows.RowWriter(3, lambda nbytes: storage, min_row_bytes=0)
    items = [writer.put(0, {"x": torch.ones(2)}), writer.put(1, {"x": torch.ones(2, dtype=torch.int64)})]
    items.append(writer.put(2, {"x": torch.zeros(2)}))
    assert not writer.active
    final = writer.final(items)
    assert [type(s["x"]) for s in final] == [torch.Tensor] * 3
    assert torch.equal(final[0]["x"], torch.ones(2)) and final[1]["x"].dtype == torch.int64


def test_slot_file_writes_land_in_the_slot_without_mapping_it():
    storage = torch.UntypedStorage._new_shared(1 << 20)
    file = shm.SlotFile.of(storage)
    assert file is not None  # torch's default sharing strategy on Linux: by file descriptor
    arena = shm.Arena(storage)
    dst = arena.alloc((4, 3, 5), torch.float32)
    src = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    file.write_tensor(dst[2], src)
    file.write_tensor(dst[0], src.T.contiguous().T * 2)  # a non-contiguous source is laid out first
    assert torch.equal(dst[2], src) and torch.equal(dst[0], src * 2)
    with pytest.raises(ValueError, match="cannot write"):
        file.write_tensor(dst[1], torch.zeros(4))


def test_slot_file_is_not_used_under_the_file_system_strategy():
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        storage = torch.UntypedStorage._new_shared(1 << 16)
        assert shm.SlotFile.of(storage) is None  # callers write through the mapping instead
    finally:
        tmp.set_sharing_strategy(before)


def test_streaming_through_the_mapping_when_no_slot_file(monkeypatch):
    """Where a slot has no file to write through, rows go through the mapping: same batches."""
    monkeypatch.setattr(shm.SlotFile, "of", classmethod(lambda cls, storage: None))
    dl = DataLoader(Numbers(24), batch_size=8, shuffle=True, seed=1, num_workers=2, decode=rich)
    seen = []
    for batch in dl:
        assert_same(batch, expected(batch["i"].tolist()))
        seen += batch["i"].tolist()
    assert sorted(seen) == list(range(24))
